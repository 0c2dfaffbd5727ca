"""The fewest tokens a text can take, known without tokenizing it.

One token stands for at most ``max_token_bytes`` bytes of the text it came from (the
longest entry of the vocabulary, added tokens included), so a text of ``B`` bytes takes
at least ``B / max_token_bytes`` tokens: a megabyte of text cannot fit a 32k context
whatever it says, and that is known in microseconds where tokenizing it takes seconds
and a gigabyte of memory (issue 33).

Exact for a byte-level BPE (Qwen, Llama 3, DeepSeek, gpt-oss, Mistral's tekken): each
character of a vocabulary entry is one byte. Any other vocabulary is measured in its
entries' UTF-8 bytes, which is never less than the text an entry stands for
(SentencePiece's ``▁`` is 3 bytes for a space, ``<0x0A>`` 6 for a newline). A Unicode
normalizer (Qwen's NFC) may shrink non-ASCII text before it is split: at most 3 bytes
to 1 (Hangul jamo into a syllable, a fullwidth letter into ASCII under NFKC), so non-ASCII
bytes count a third. A tokenizer whose normalizer or pre-tokenizer may drop text
(whitespace splitting, BERT's cleaning, stripping, SentencePiece's precompiled maps)
has no floor: ``token_floor`` returns None.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

# normalizers that may turn a few non-ASCII bytes into fewer (at most 3 into 1) and leave
# ASCII as it is (lowercasing ASCII keeps its length)
_UNICODE = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
SHRINK = 3
# pre-tokenizers that keep every byte of the text (split, map or mark it)
_KEEPING = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})
_SPLITTING = frozenset({"Split", "Punctuation"})  # keep all unless their behavior is Removed


@dataclass(frozen=True)
class TokenFloor:
    max_token_bytes: int  # the most bytes of text one token stands for
    shrink: int = 1  # how far the normalizer may shrink non-ASCII bytes (1: not at all)

    def text_bytes(self, text: str) -> int:
        """The fewest bytes ``text`` has once normalized (its UTF-8 length, less what a
        normalizer may take off its non-ASCII part)."""
        if text.isascii():  # O(1): CPython knows
            return len(text)
        total = len(text.encode("utf-8", "surrogatepass"))
        if self.shrink == 1:
            return total
        ascii_bytes = len(text.encode("ascii", "ignore"))
        return ascii_bytes + (total - ascii_bytes) // self.shrink

    def tokens(self, texts: Iterable[str]) -> int:
        """The fewest tokens a prompt holding all of ``texts`` can have."""
        return sum(self.text_bytes(t) for t in texts) // self.max_token_bytes

    def refused_bytes(self, tokens: int) -> int:
        """The fewest bytes of ASCII text that cannot fit ``tokens`` tokens (of non-ASCII
        text under a Unicode normalizer: ``shrink`` times as many)."""
        return (tokens + 1) * self.max_token_bytes


def token_floor(tokenizer: Tokenizer) -> TokenFloor | None:
    """``tokenizer``'s floor; None when its normalizer or pre-tokenizer may drop text."""
    shrink = _shrink(_state(tokenizer.normalizer))
    pre = _state(tokenizer.pre_tokenizer)
    if shrink is None or not _keeps_text(pre):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    # a byte-level vocabulary spells each byte as one character
    measure = len if _has_byte_level(pre) else _utf8_len
    longest = max(map(measure, vocab), default=1)
    added = tokenizer.get_added_tokens_decoder().values()
    longest = max([longest, *(_utf8_len(t.content) for t in added)])
    return TokenFloor(max_token_bytes=max(longest, 1), shrink=shrink)


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _state(component: Any) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _shrink(state: dict | None) -> int | None:
    if state is None:
        return 1
    kind = state.get("type")
    if kind == "Sequence":
        parts = [_shrink(s) for s in state.get("normalizers", [])]
        return None if None in parts else max(parts, default=1)
    if kind in _UNICODE:
        return SHRINK
    if kind == "Prepend":
        return 1
    if kind == "Replace":  # a literal replaced by one as long or longer (" " -> "▁")
        pattern = (state.get("pattern") or {}).get("String")
        if pattern and _utf8_len(state.get("content", "")) >= _utf8_len(pattern):
            return 1
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, Nmt, ...


def _keeps_text(state: dict | None) -> bool:
    if state is None:
        return True
    kind = state.get("type")
    if kind == "Sequence":
        return all(_keeps_text(s) for s in state.get("pretokenizers", []))
    if kind in _SPLITTING:
        return state.get("behavior") != "Removed"
    return kind in _KEEPING  # not Whitespace, WhitespaceSplit, BertPreTokenizer, ...


def _has_byte_level(state: dict | None) -> bool:
    if state is None:
        return False
    if state.get("type") == "Sequence":
        return any(_has_byte_level(s) for s in state.get("pretokenizers", []))
    return state.get("type") == "ByteLevel"
