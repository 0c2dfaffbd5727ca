"""BusyPoll keeps the event loop polling while a watched reply is due, within its budget."""

from __future__ import annotations

import asyncio
import time

from proxy.io.spin import BusyPoll


async def test_off_when_the_budget_is_zero():
    poll = BusyPoll(0.0)
    future = asyncio.get_running_loop().create_future()
    poll.watch(future)
    await asyncio.sleep(0.01)
    assert poll.spinning is None and poll.pending == 0 and poll.ticks == 0
    future.set_result(None)


async def test_polls_while_a_reply_is_due_and_stops_when_it_is_back():
    poll = BusyPoll(1.0)
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    poll.watch(future)
    for _ in range(100):  # a loaded machine may lend the loop little of those 20 ms
        await asyncio.sleep(0.005)  # the loop would sleep in epoll for all of it unpolled
        if poll.ticks > 20:
            break
    assert poll.spinning is loop and poll.pending == 1
    assert poll.ticks > 20  # polled over and over, not once per sleep
    future.set_result(None)
    await asyncio.sleep(0.005)
    assert poll.spinning is None and poll.pending == 0
    ticks = poll.ticks
    await asyncio.sleep(0.02)
    assert poll.ticks == ticks  # asleep again


async def test_a_slow_reply_costs_at_most_the_budget():
    poll = BusyPoll(0.01)
    future = asyncio.get_running_loop().create_future()
    poll.watch(future)
    await asyncio.sleep(0.05)
    assert poll.spinning is None and poll.pending == 1  # gave up; the reply is still due
    ticks = poll.ticks
    await asyncio.sleep(0.02)
    assert poll.ticks == ticks
    future.cancel()
    await asyncio.sleep(0)
    assert poll.pending == 0  # a cancelled wait counts as back


async def test_each_request_renews_the_budget():
    # budgets long enough that a loaded machine's pauses (tens of ms) cannot use up the
    # second request's before the check: the check comes 0.3 s inside it
    budget = 0.6
    poll = BusyPoll(budget)
    loop = asyncio.get_running_loop()
    first = loop.create_future()
    poll.watch(first)
    first_at = time.monotonic()
    await asyncio.sleep(budget / 2)
    second = loop.create_future()
    poll.watch(second)
    while time.monotonic() < first_at + budget + 0.01:  # past the first one's budget
        await asyncio.sleep(0.01)
    assert poll.spinning is loop
    for f in (first, second):
        f.set_result(None)
