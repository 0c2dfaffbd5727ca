"""Pause and resume around weight updates: new calls wait, in-flight calls drain."""

from __future__ import annotations

import asyncio


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

    def call(self) -> _Admitted:
        """Wrap one model call (``async with gate.call()``): waits while paused, counts
        while in flight."""
        return _Admitted(self)

    async def pause(self, timeout: float | None = None) -> int:
        """Stop admitting calls and wait for in-flight ones; returns how many drained."""
        self._open.clear()
        n = self._inflight
        await asyncio.wait_for(self._drained.wait(), timeout)
        return n

    def resume(self) -> None:
        self._open.set()


class _Admitted:
    """One call through the gate (a plain class: cheaper per call than a generator-based
    context manager)."""

    __slots__ = ("gate",)

    def __init__(self, gate: WeightGate) -> None:
        self.gate = gate

    async def __aenter__(self) -> None:
        gate = self.gate
        if not gate._open.is_set():
            await gate._open.wait()
        gate._inflight += 1
        gate._drained.clear()

    async def __aexit__(self, *exc) -> None:
        gate = self.gate
        gate._inflight -= 1
        if gate._inflight == 0:
            gate._drained.set()
