"""``Deadlines``: a future not done by its deadline has its ``expired`` called, once; one
done in time does not; a shorter timeout added later still fires on time; the one timer
follows the earliest deadline."""

from __future__ import annotations

import asyncio

from services.common.deadlines import Deadlines


async def test_only_the_futures_not_done_in_time_expire() -> None:
    loop = asyncio.get_running_loop()
    due = Deadlines(loop)
    expired: list[str] = []
    answered, stuck = loop.create_future(), loop.create_future()
    due.add(answered, 0.05, lambda: expired.append("answered"))
    due.add(stuck, 0.05, lambda: expired.append("stuck"))
    answered.set_result("ok")
    await asyncio.sleep(0.15)
    assert expired == ["stuck"]
    assert len(due) == 0  # nothing left waiting
    await asyncio.sleep(0.1)
    assert expired == ["stuck"]  # once


async def test_a_shorter_timeout_added_later_fires_on_its_own_deadline() -> None:
    loop = asyncio.get_running_loop()
    due = Deadlines(loop)
    fired: dict[str, float] = {}
    start = loop.time()
    due.add(loop.create_future(), 10.0, lambda: fired.setdefault("long", loop.time()))
    due.add(loop.create_future(), 0.05, lambda: fired.setdefault("short", loop.time()))
    await asyncio.sleep(0.2)
    assert list(fired) == ["short"] and fired["short"] - start < 0.15
    assert len(due) == 1  # the long one still waits, on a timer of its own deadline
    due.clear()


async def test_done_futures_leave_from_the_head_as_new_ones_come() -> None:
    loop = asyncio.get_running_loop()
    due = Deadlines(loop)
    for _ in range(1000):  # answered in order, as engine replies and acks mostly are
        future = loop.create_future()
        due.add(future, 60.0, lambda: None)
        future.set_result(None)
    assert len(due._due) == 1  # only the last, answered since it was added
    due.clear()
