"""The segment cache encodes exactly as the tokenizer does, cold and warm."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from services.common.tokenization import segments
from services.common.tokenization.segments import SegmentEncoder

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "completions"


def plain(tok, text: str) -> list[int]:
    return tok.tokenizer.encode(text, add_special_tokens=False).ids


@pytest.fixture
def fresh(tok):
    """The tiny model's tokenizer with an empty cache of its own."""
    enc = SegmentEncoder.for_tokenizer(tok.tokenizer)
    assert enc is not None
    return enc


def pieces(tok) -> st.SearchStrategy[str]:
    added = sorted(t.content for t in tok.tokenizer.get_added_tokens_decoder().values())
    words = st.text(
        alphabet=st.sampled_from(list("ab c\n\t  xyz.,{}\"'é漢😀<|>_")), min_size=0, max_size=40
    )
    long_words = st.builds(lambda w, n: w * n, words, st.integers(1, 60))
    return st.lists(st.one_of(words, long_words, st.sampled_from(added)), max_size=30).map("".join)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_text_encodes_as_the_tokenizer_does_cold_and_warm(tok, fresh, data):
    text = data.draw(pieces(tok))
    assert fresh.encode(text) == plain(tok, text)
    assert fresh.encode(text) == plain(tok, text)  # now from the cache where long


def test_real_harness_prompts_encode_exactly_and_hit_the_cache(tok, fresh):
    texts = []
    for name in ("sub_agent", "compaction", "side_calls", "side_calls_router"):
        for line in (FIXTURES / f"{name}.jsonl").read_bytes().splitlines():
            norm = orjson.loads(line)["normalized"]
            texts.append(tok.render(norm["messages"], norm["tools"] or None))
    for text in texts:
        assert fresh.encode(text) == plain(tok, text)
    # each CLI's system prompt and tool list are encoded once, then reused
    assert fresh.hits > fresh.misses > 0


def test_the_cache_stays_within_its_budget(tok, fresh):
    fresh.cache.budget = 20000
    sep = "<|im_end|>"
    texts = [sep.join(f"{i} {w} " * 200 for w in ("alpha", "beta", "gamma")) for i in range(10)]
    for text in texts:
        assert fresh.encode(text) == plain(tok, text)
        assert fresh.cache.used <= 20000 or len(fresh.cache) == 1
    entries = fresh.cache.entries.items()
    assert fresh.cache.used == sum(4 * len(ids) + len(piece) for piece, ids in entries)
    assert len(fresh.cache) < 3 * len(texts)  # old pieces were dropped


def test_a_piece_of_megabytes_is_encoded_but_not_kept(tok, fresh, monkeypatch):
    """A huge prompt (issue 33) would push every harness's system prompt out and hold its
    memory: a piece over ``MAX_PIECE_BYTES`` (scaled down here) is not cached."""
    monkeypatch.setattr(segments, "MAX_PIECE_BYTES", 10_000)
    huge, small = "w01234 " * 2000, "a short tool result"
    text = f"<|im_start|>user\n{huge}<|im_end|>\n<|im_start|>user\n{small}<|im_end|>"
    assert fresh.encode(text) == plain(tok, text)
    assert f"user\n{huge}" not in fresh.cache.entries and fresh.cache.used < 10_000
    assert f"user\n{small}" in fresh.cache.entries  # a piece between special tokens


def test_a_tokenizer_whose_added_tokens_touch_their_neighbours_is_not_segmented():
    def with_added(**flags) -> Tokenizer:
        t = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        t.add_special_tokens([AddedToken("<s>", normalized=False, **flags)])
        return t

    assert SegmentEncoder.for_tokenizer(with_added()) is not None
    assert SegmentEncoder.for_tokenizer(with_added(lstrip=True)) is None
    assert SegmentEncoder.for_tokenizer(with_added(rstrip=True)) is None
    assert SegmentEncoder.for_tokenizer(with_added(single_word=True)) is None
    bare = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    assert SegmentEncoder.for_tokenizer(bare) is None


def test_the_chat_tokenizer_uses_it(tok):
    assert tok.segments is not None
    text = tok.render(
        [{"role": "system", "content": "S " * 800}, {"role": "user", "content": "hi"}]
    )
    assert tok.encode(text) == plain(tok, text)


def test_short_pieces_are_cached_too_and_new_ones_cost_one_call_per_cluster(tok, fresh):
    calls = []
    encode = fresh._encode
    fresh._encode = lambda text: calls.append(text) or encode(text)
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    far = "<|im_start|>user\n" + "filler text " * 400 + "<|im_end|>\n"  # > JOIN_GAP_CHARS
    first = system + far + "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
    assert fresh.encode(first) == plain(tok, first)
    assert len(calls) == 1  # every piece new, all in one span
    calls.clear()
    assert fresh.encode(first) == plain(tok, first)
    assert calls == []  # every piece cached, even the two-character ones
    # two new pieces far apart (a cached piece between them): one call each, not one
    # call re-encoding the cached text between them
    second = first.replace("You are", "You were").replace("Say hello.", "Say bye.")
    assert fresh.encode(second) == plain(tok, second)
    assert calls == ["system\nYou were a helpful assistant.", "user\nSay bye."]


def test_a_split_the_tokenizer_disagrees_with_falls_back_to_plain_encoding(tok, fresh):
    text = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    special = tok.tokenizer.token_to_id("<|im_end|>")
    real = fresh._encode
    # as if the tokenizer merged a special token away inside a span (it never does for a
    # tokenizer for_tokenizer accepts; the check is what makes the cache safe regardless)
    fresh._encode = lambda t: [i for i in real(t) if i != special] if t != text else real(t)
    assert fresh.encode(text) == plain(tok, text)
    assert len(fresh.cache) == 0  # nothing from the disagreeing split was kept
