"""Futures that each have a deadline, on one timer for the earliest.

The proxy's hot path armed a timer per request and cancelled it when the reply came
first (``call_later``, ``cancel``): one for the engine's answer and one for JetStream's
ack, on every call, each a uvloop handle and a libuv timer. Here a deadline is an entry
in a queue kept in the order added; replies mostly come in that order, so the done ones
leave from its head as new ones come, and the one timer is re-armed only when a
deadline earlier than its own comes in (a shorter timeout), or when it fires.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class Deadlines:
    __slots__ = ("loop", "_due", "_timer", "_at")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._due: deque[tuple[float, asyncio.Future, Callable[[], None]]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0

    def add(self, future: asyncio.Future, after: float, expired: Callable[[], None]) -> None:
        """Call ``expired()`` if ``future`` is not done ``after`` seconds from now."""
        due = self._due
        while due and due[0][1].done():
            due.popleft()
        deadline = self.loop.time() + after
        due.append((deadline, future, expired))
        if self._timer is None or deadline < self._at:
            self._arm(deadline)

    def clear(self) -> None:
        """Forget every deadline (their futures were failed by other means)."""
        self._due.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def __len__(self) -> int:
        return sum(1 for _, future, _ in self._due if not future.done())

    def _arm(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._at = self.loop.call_at(deadline, self._fire), deadline

    def _fire(self) -> None:
        self._timer = None
        now, waiting = self.loop.time(), deque()
        for entry in self._due:
            deadline, future, expired = entry
            if future.done():
                continue
            if deadline <= now:
                expired()
            else:
                waiting.append(entry)
        self._due = waiting
        if waiting:
            self._arm(min(entry[0] for entry in waiting))
