"""Stopping background tasks so that they really stop.

Python 3.11's ``asyncio.wait_for`` loses a cancel that arrives in the loop turn where the
awaited future completes: it returns the result instead of raising (CPython gh-86296,
fixed in 3.12's rewrite). nats-py's requests and our own connect paths use ``wait_for``,
so a periodic loop cancelled at that moment runs on, and ``await task`` after one
``cancel()`` waits forever (tests/unit/common/test_tasks.py shows it; a dashboard stop hung
CI this way). ``cancel_and_wait`` cancels again whatever is still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

# how long one cancel gets before it is repeated: a task that unwinds (closes a sandbox, a
# connection) keeps its time, since a repeat only re-raises at its next await
RECANCEL_S = 0.5


async def cancel_and_wait(tasks: Iterable[asyncio.Task], recancel_s: float = RECANCEL_S) -> None:
    """Cancel ``tasks`` and return once every one has ended; their exceptions are
    retrieved (a task that failed before the stop was already logged by its owner)."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_s)
    for task in tasks:
        if not task.cancelled():
            task.exception()
