"""Encoding prompts piece by piece, each piece between special tokens cached.

A prompt is mostly text the proxy has tokenized before: a harness's system prompt and
tool list (15-30k tokens, the same in every session), the task's user message (the same
in every rollout of a group), the template's short role headers. Tokenizing a long
prompt costs ~20 ms of CPU, a short one ~30 µs of the tokenizer's fixed cost; with
its pieces cached it is a regex split and a dictionary lookup per piece. Only the
pieces not seen before (a new tool result) go through the tokenizer.

Why it is exact: a ``tokenizers`` Tokenizer first splits the text at its added tokens
and runs normalizer, pre-tokenizer and model on each piece in between on its own, so
``encode(a + special + b) == encode(a) + [special] + encode(b)``. That holds when every
added token matches the raw text and touches no neighbouring characters (not
normalized, unless the normalizer changes nothing; no lstrip/rstrip/single_word); ``SegmentEncoder.for_tokenizer`` returns
None for a tokenizer where it might not, and plain encoding is used. Pieces not cached
are tokenized in their place in the text (a span cut at special tokens, itself exact),
and the result is checked against the split; on any mismatch the whole text is encoded
plainly and nothing is cached.
"""

from __future__ import annotations

import json
import re
from array import array
from itertools import chain

from tokenizers import Tokenizer

from services.common.tokenization.lru import SizedLRU

MAX_CACHED_BYTES = 32_000_000  # packed ids and the text they key, ~4M tokens of prose
# A larger piece (a prompt of megabytes, seldom sent twice) is not kept: it would push out
# every harness's system prompt and tools, and hold its memory until they push it out.
MAX_PIECE_BYTES = MAX_CACHED_BYTES // 16
# Pieces not cached that lie closer than this are tokenized in one call (the tokenizer's
# fixed cost is ~20 µs a call; re-encoding this much cached text costs about as much).
JOIN_GAP_CHARS = 2048


class SegmentEncoder:
    def __init__(self, tokenizer: Tokenizer, added: dict[str, int]) -> None:
        self.tokenizer = tokenizer
        self.added = added
        # leftmost match, longest first among tokens starting at the same place (as the
        # tokenizer's own added-vocabulary matcher does)
        alternatives = sorted(added, key=len, reverse=True)
        self.split = re.compile("|".join(re.escape(t) for t in alternatives))
        self.cache: SizedLRU[str, array] = SizedLRU(MAX_CACHED_BYTES, _cached_bytes)
        self.hits = self.misses = 0

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> SegmentEncoder | None:
        added = tokenizer.get_added_tokens_decoder()
        if not added:
            return None
        # a "normalized" token is matched in normalized text: the raw text's own match
        # when the normalizer changes nothing (DeepSeek's chat tokens, an empty Sequence)
        plain = _identity_normalizer(tokenizer)
        for token in added.values():
            if (
                (token.normalized and not plain)
                or token.lstrip
                or token.rstrip
                or token.single_word
            ):
                return None
        return cls(tokenizer, {t.content: i for i, t in added.items()})

    def encode(self, text: str) -> list[int]:
        # chunks: each piece's ids (None until tokenized) and each special token's id
        chunks: list[array | list[int] | tuple[int] | None] = []
        missing: list[tuple[int, int, int]] = []  # (chunk index, start, end) of new pieces
        get, added = self.cache.get, self.added
        pos = 0
        for match in self.split.finditer(text):
            start = match.start()
            if start > pos:
                ids = get(text[pos:start])
                if ids is None:
                    missing.append((len(chunks), pos, start))
                chunks.append(ids)
            chunks.append((added[match.group()],))
            pos = match.end()
        if pos < len(text):
            ids = get(text[pos:])
            if ids is None:
                missing.append((len(chunks), pos, len(text)))
            chunks.append(ids)
        self.hits += len(chunks) - len(missing)  # counts special tokens too: cheap either way
        self.misses += len(missing)
        if missing and not self._fill(text, chunks, missing):
            return self._encode(text)
        return list(chain.from_iterable(chunks))

    def _fill(self, text: str, chunks: list, missing: list[tuple[int, int, int]]) -> bool:
        """Tokenize the new pieces, nearby ones in one call, and cache them. False if the
        tokenizer's split of a span is not the one expected (then nothing is cached)."""
        found: list[tuple[str, list[int]]] = []
        group = [missing[0]]
        for item in missing[1:] + [None]:
            if item is not None and item[1] - group[-1][2] <= JOIN_GAP_CHARS:
                group.append(item)
                continue
            first, last = group[0], group[-1]
            ids = self._encode(text[first[1] : last[2]])
            pieces = {i: (s, e) for i, s, e in group}
            k = 0
            for index in range(first[0], last[0] + 1):
                chunk = chunks[index]
                if index in pieces:  # a new piece: up to the next special token, or the end
                    stop = len(ids) if index == last[0] else _find(ids, chunks[index + 1][0], k)
                    if stop < 0:
                        return False
                    s, e = pieces[index]
                    found.append((text[s:e], ids[k:stop]))
                    chunks[index] = ids[k:stop]
                    k = stop
                else:  # a cached piece or a special token: must tokenize as it did before
                    n = len(chunk)
                    if ids[k : k + n] != list(chunk):
                        return False
                    k += n
            if k != len(ids):
                return False
            group = [item] if item is not None else []
        for piece, ids in found:
            packed = array("I", ids)
            if _cached_bytes(piece, packed) <= MAX_PIECE_BYTES:
                self.cache.put(piece, packed)
        return True

    def _encode(self, text: str) -> list[int]:
        return encode_plain(self.tokenizer, text)


# ``Tokenizer.encode`` holds the GIL for the whole text (seconds for megabytes: every
# other thread, the proxy's event loop included, stops); ``encode_batch`` releases it and
# gives the same ids. Short texts keep ``encode``, which has less overhead.
RELEASE_GIL_CHARS = 16 * 1024


def encode_plain(tokenizer: Tokenizer, text: str) -> list[int]:
    """``text``'s ids, no special tokens added; long texts without holding the GIL."""
    if len(text) < RELEASE_GIL_CHARS:
        return tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids


def _identity_normalizer(tokenizer: Tokenizer) -> bool:
    normalizer = tokenizer.normalizer
    if normalizer is None:
        return True
    return json.loads(normalizer.__getstate__()) in ({"type": "Sequence", "normalizers": []},)


def _cached_bytes(piece: str, ids: array) -> int:
    # the text counts too: every piece is cached now, and whitespace or repeated text
    # can be many characters per token
    return ids.itemsize * len(ids) + len(piece)


def _find(ids: list[int], value: int, start: int) -> int:
    try:
        return ids.index(value, start)
    except ValueError:
        return -1
