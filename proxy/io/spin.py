"""Busy-poll the event loop, briefly, while a reply from a fast upstream is due.

When the loop has nothing to run it sleeps in ``epoll_wait`` and its core may go idle;
the reply that wakes it then waits for the core to wake too. On virtual machines that
costs ~80 µs per wait (measured here: a Redis round trip across cores 125 µs asleep,
43 µs polling), and a proxied model call waits on three such replies: its session
lookup, its record's ack and its state's write. Not on the engine's: a generation takes
milliseconds at least, so polling through it would spend the whole budget on every call
(measured against an engine answering in 20 ms, one session: 829 µs of the proxy's CPU
a call with the engine watched, 642 without, the same p50). While a watched reply is
pending, ``BusyPoll`` keeps one callback scheduled, so the loop polls
with a zero timeout instead of sleeping, for at most ``budget`` seconds after the last
request went out: a reply slower than that costs at most ``budget`` of CPU, then the
loop sleeps as before. ``budget`` 0 turns it off.

An idle poll also yields the CPU (``sched_yield``, which lets go of the GIL): a thread
that needs it (the log writer; under granian, which served the proxy before
``proxy.io.native``, every request and answer crossed one) is not starved. A busy loop
(other callbacks ran between two polls) does not yield: that syscall per loop turn cost
~15% of throughput at 64 sessions.
"""

from __future__ import annotations

import asyncio
import os
import time

IDLE_TICK_S = 20e-6  # ticks this close together: the loop has nothing else to run


class BusyPoll:
    __slots__ = ("budget", "pending", "until", "spinning", "ticks", "last")

    def __init__(self, budget: float = 0.0) -> None:
        self.budget = budget
        self.pending = 0
        self.until = 0.0
        self.spinning: asyncio.AbstractEventLoop | None = None  # the loop kept polling
        self.ticks = 0  # polls so far (what tests look at)
        self.last = 0.0

    def watch(self, future: asyncio.Future) -> None:
        """Poll while ``future`` (a reply on its way) is pending, within the budget."""
        if self.budget <= 0:
            return
        self.pending += 1
        future.add_done_callback(self._done)
        self.until = time.monotonic() + self.budget  # the loop's clock is too coarse
        loop = future.get_loop()
        if self.spinning is not loop:
            self.spinning = loop
            loop.call_soon(self._tick, loop)

    def _done(self, _future: asyncio.Future) -> None:
        self.pending -= 1

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.spinning is not loop:
            return  # a newer loop took over
        now = time.monotonic()
        if self.pending > 0 and now < self.until:
            self.ticks += 1
            if now - self.last < IDLE_TICK_S:  # idle: let other threads at the GIL
                os.sched_yield()
            self.last = time.monotonic()
            loop.call_soon(self._tick, loop)
        else:
            self.spinning = None


POLL = BusyPoll()  # the process's: its services set the budget at start
