"""Reuse of finished sequences' KV caches for later prompts that share their prefix.

An agent session's next call usually extends its previous prompt + reply, so keeping the
finished caches (bounded by a token budget, least recently used out first) turns most
prefills into short tail prefills. Entries are copied on use and dropped on weight swap.
"""

from __future__ import annotations

from collections import OrderedDict

from services.engine.model import KVCache


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (binary search over C-level slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, tuple[list[int], KVCache]] = OrderedDict()
        self._next_key = 0
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> int:
        dropped = len(self._entries)
        self._entries.clear()
        self.tokens = 0
        return dropped

    def insert(self, tokens: list[int], cache: KVCache) -> None:
        """Keep ``cache`` (holding exactly ``tokens``); entries it extends are dropped."""
        if not tokens or len(tokens) > self.max_tokens:
            return
        for key, (old, _) in list(self._entries.items()):
            if len(old) <= len(tokens) and tokens[: len(old)] == old:
                self._drop(key)
        self._entries[self._next_key] = (tokens, cache)
        self._next_key += 1
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def lookup(self, prompt: list[int]) -> tuple[KVCache, int] | None:
        """A private copy of the best cache for ``prompt`` and how many tokens it covers.
        At least one prompt token is always left to compute (its logits start sampling)."""
        best_key, best_len = None, 0
        for key, (tokens, _) in self._entries.items():
            n = common_prefix(tokens, prompt)
            if n > best_len:
                best_key, best_len = key, n
        reuse = min(best_len, len(prompt) - 1)
        if best_key is None or reuse <= 0:
            return None
        self._entries.move_to_end(best_key)
        return self._entries[best_key][1].truncated_copy(reuse), reuse

    def _drop(self, key: int) -> None:
        tokens, _ = self._entries.pop(key)
        self.tokens -= len(tokens)
