"""Runtime-pool decisions: which init work to start next, whether there is room, and
whether a preparation under way is still wanted.

Bounds per node (checked against the registry's per-node stage sets):
- at most ``max_init`` sessions INITIALIZING;
- at most ``max_run + ready_buffer`` sessions held at once (INITIALIZING + READY +
  RUNNING): an INIT starts only for a free run slot or a free place in the buffer;
- at most ``ready_buffer`` sessions READY (handed over, not yet taken by the executor),
  whatever the executor does: a prepared runtime goes READY only while there is room,
  else it waits, still INITIALIZING and holding its INIT slot, so a lagging executor
  stops new INITs instead of growing the buffer.
``ready_buffer=0`` is just-in-time preparation: an INIT starts only for a free run slot,
and prepared runtimes are handed over one at a time (READY <= 1).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from schemas import Session, SessionState
from schemas.topology import NODE_DEFAULTS

T = TypeVar("T")


@dataclass(frozen=True)
class Limits:
    max_init: int = NODE_DEFAULTS.max_init
    ready_buffer: int = NODE_DEFAULTS.ready_buffer
    max_run: int = NODE_DEFAULTS.max_run

    def __post_init__(self) -> None:
        if self.max_init < 1 or self.max_run < 1 or self.ready_buffer < 0:
            raise ValueError("need max_init >= 1, max_run >= 1, ready_buffer >= 0")


def room_to_init(initializing: int, ready: int, running: int, limits: Limits) -> int:
    """How many more INITs may start now."""
    by_init = limits.max_init - initializing
    by_hold = limits.max_run + limits.ready_buffer - (initializing + ready + running)
    return max(0, min(by_init, by_hold))


def held_by_runs(initializing: int, ready: int, running: int, limits: Limits) -> bool:
    """Whether the hold bound, not the INIT slots, limits INITs now: the end of a run
    (which frees a held place, not an INIT slot) may then make room."""
    by_init = limits.max_init - initializing
    by_hold = limits.max_run + limits.ready_buffer - (initializing + ready + running)
    return by_hold < by_init


def ready_room(ready: int, limits: Limits) -> int:
    """How many prepared runtimes may go READY now (``ready``: the node's READY count)."""
    return max(0, ready_cap(limits) - ready)


def ready_cap(limits: Limits) -> int:
    return max(limits.ready_buffer, 1)  # a hand-over passes through READY even just in time


def prepared_for_nobody(session: Session | None, attempt: int) -> str | None:
    """Why a preparation of ``attempt`` is of no use any more (``session``: as read now,
    None if gone), or None while its session waits for it: INITIALIZING at that attempt,
    the only state a session is in while its INIT prepares (only the INIT moves it on)."""
    if session is None:
        return "gone"
    if session.attempt != attempt:
        return f"at attempt {session.attempt}"
    if session.state != SessionState.INITIALIZING:
        return session.state.value
    return None


@dataclass(order=True)
class _Entry(Generic[T]):
    neg_priority: int
    arrival: int
    item: T = field(compare=False)


class PriorityQueue(Generic[T]):
    """Higher priority first; FIFO within a priority level."""

    def __init__(self) -> None:
        self._heap: list[_Entry[T]] = []
        self._arrivals = itertools.count()

    def push(self, priority: int, item: T) -> None:
        heapq.heappush(self._heap, _Entry(-priority, next(self._arrivals), item))

    def pop(self) -> T:
        return heapq.heappop(self._heap).item

    def __len__(self) -> int:
        return len(self._heap)

    def items(self) -> list[T]:
        return [e.item for e in self._heap]
