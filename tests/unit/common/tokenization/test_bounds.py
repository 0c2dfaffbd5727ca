"""The token floor (``bounds.py``) is never above the real count, on the tiny model and
on each real vocabulary of the family fixtures, for the texts that come closest to it:
runs of a vocabulary's longest entries, added tokens back to back, and text a Unicode
normalizer shrinks. A tokenizer that may drop text gets no floor."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from services.common.tokenization import ChatTokenizer
from services.common.tokenization.bounds import SHRINK, TokenFloor, token_floor
from services.common.tokenization.tokenizer import _context_tokens
from tests.helpers.model_families import family_model_dir

# one fixture per vocabulary (Qwen3.5 and 3.6, Llama 3.1 and 3.2 share theirs)
VOCABULARIES = ("qwen3", "qwen3_5", "llama3_1", "gpt_oss", "deepseek_v3", "mistral")
HANGUL_JAMO = "\u1112\u1161\u11ab"  # 9 bytes, one syllable (3 bytes) once NFC-composed


def count(tok: ChatTokenizer, text: str) -> int:
    return len(tok.tokenizer.encode(text, add_special_tokens=False).ids)


def hardest_texts(tok: ChatTokenizer) -> list[str]:
    """Texts whose every token is as long as a token gets."""
    vocab = tok.tokenizer.get_vocab(with_added_tokens=False)
    longest = sorted(vocab, key=len, reverse=True)[:20]
    texts = [tok.token_text(vocab[t]) * 50 for t in longest]
    added = [t.content for t in tok.tokenizer.get_added_tokens_decoder().values()]
    texts.append("".join(sorted(added, key=len, reverse=True)[:20]) * 20)
    texts += [" " * 5000, "\n" * 5000, "-" * 5000, "=" * 5000, "\t" * 5000]
    texts += [HANGUL_JAMO * 500, "\uff21" * 1000, "e\u0301" * 1000, "漢字" * 1000]
    return texts


def check(tok: ChatTokenizer, texts: list[str]) -> None:
    floor = tok.token_floor
    assert floor is not None
    for text in texts:
        assert floor.tokens([text]) <= count(tok, text), (text[:40], floor)


@pytest.fixture(scope="module", params=VOCABULARIES)
def family_tok(request) -> ChatTokenizer:
    return ChatTokenizer.load(family_model_dir(request.param))


def test_the_floor_holds_for_the_hardest_texts_of_the_tiny_model(tok):
    check(tok, hardest_texts(tok))
    # a run of the longest entry is the floor itself: nothing looser than needed
    text = "</tool_response>" * 100
    assert tok.token_floor.max_token_bytes == len("</tool_response>")
    assert tok.token_floor.tokens([text]) == count(tok, text) == 100


def test_the_floor_holds_for_the_hardest_texts_of_each_real_vocabulary(family_tok):
    floor = family_tok.token_floor
    assert floor is not None and floor.max_token_bytes <= 128, floor
    check(family_tok, hardest_texts(family_tok))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([" ", "\n", "a", "é", "漢", "😀", "-", HANGUL_JAMO, "\uff21"])))
def test_the_floor_holds_for_any_mix(tok, chars):
    text = "".join(c * 37 for c in chars)
    check(tok, [text])


def test_a_unicode_normalizer_counts_non_ascii_bytes_a_third():
    vocab = {"a": 0, "ab": 1, "\u1112": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.normalizer = normalizers.NFC()
    floor = token_floor(tok)
    assert floor == TokenFloor(max_token_bytes=3, shrink=SHRINK)
    assert floor.text_bytes("abc") == 3  # ASCII as it is
    composed = unicodedata.normalize("NFC", HANGUL_JAMO)
    assert len(composed.encode()) == 3 and floor.text_bytes(HANGUL_JAMO) == 3


@pytest.mark.parametrize(
    "normalizer, pre_tokenizer",
    [
        (None, pre_tokenizers.Whitespace()),  # drops every space
        (None, pre_tokenizers.WhitespaceSplit()),
        (None, pre_tokenizers.BertPreTokenizer()),
        (None, pre_tokenizers.Split(" ", behavior="removed")),
        (normalizers.BertNormalizer(), None),  # drops control characters
        (normalizers.Strip(), None),
        (normalizers.Replace("  ", " "), None),  # two bytes become one
    ],
)
def test_a_tokenizer_that_may_drop_text_has_no_floor(normalizer, pre_tokenizer):
    tok = Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    assert token_floor(tok) is None


def test_sentencepiece_entries_count_their_utf8_bytes():
    tok = Tokenizer(models.WordLevel({"▁the": 0, "<0x0A>": 1}, unk_token="<0x0A>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    assert token_floor(tok) == TokenFloor(max_token_bytes=6, shrink=1)  # "▁the", "<0x0A>"


def test_the_models_context_comes_from_its_config():
    assert _context_tokens({"max_position_embeddings": 32768}) == 32768
    assert _context_tokens({"text_config": {"max_position_embeddings": 8192}}) == 8192
    scaled = {"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    assert _context_tokens(scaled) == 131072
    assert _context_tokens({}) is None
