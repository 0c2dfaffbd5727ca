"""Pause and resume around weight updates: new calls wait, in-flight calls drain."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager


class WeightGate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._inflight = 0
        self._drained = asyncio.Event()
        self._drained.set()

    @property
    def inflight(self) -> int:
        """Calls admitted and not yet answered."""
        return self._inflight

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    @asynccontextmanager
    async def call(self):
        """Wrap one model call: waits while paused, counts while in flight."""
        await self._open.wait()
        self._inflight += 1
        self._drained.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._drained.set()

    async def pause(self, timeout: float | None = None) -> int:
        """Stop admitting calls and wait for in-flight ones; returns how many drained."""
        self._open.clear()
        n = self._inflight
        await asyncio.wait_for(self._drained.wait(), timeout)
        return n

    def resume(self) -> None:
        self._open.set()
