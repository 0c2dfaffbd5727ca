"""The single connection of a small asyncio client (``proxy.io.resp``, ``jspub``): opened
on first use and again after it was lost, one attempt shared by every caller waiting."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar


class Connected(Protocol):
    lost: Exception | None  # set by connection_lost: this connection is done
    transport: asyncio.Transport | None


P = TypeVar("P", bound=Connected)


class OneConnection(Generic[P]):
    def __init__(self, open_: Callable[[], Awaitable[P]]) -> None:
        self._open = open_
        self._proto: P | None = None
        self._lock: asyncio.Lock | None = None

    @property
    def live(self) -> P | None:
        """The connection if it is usable now (the hot path: no await)."""
        proto = self._proto
        return proto if proto is not None and proto.lost is None else None

    async def get(self) -> P:
        proto = self.live
        if proto is not None:
            return proto
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            proto = self.live
            if proto is None:
                proto = self._proto = await self._open()
            return proto

    def close(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None
