"""The segment cache encodes exactly as the tokenizer does, cold and warm."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from proxy.tokenization.segments import SegmentEncoder

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "completions"


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
    fresh.cache.budget = 2000
    sep = "<|im_end|>"
    texts = [sep.join(f"{i} {w} " * 200 for w in ("alpha", "beta", "gamma")) for i in range(10)]
    for text in texts:
        assert fresh.encode(text) == plain(tok, text)
        assert fresh.cache.used <= 2000 or len(fresh.cache) == 1
    assert fresh.cache.used == sum(len(v) for v in fresh.cache.entries.values())


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
