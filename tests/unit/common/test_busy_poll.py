"""BusyPoll keeps the event loop polling while a watched reply is due, within its budget."""

from __future__ import annotations

import asyncio

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
    await asyncio.sleep(0.02)  # the loop would sleep in epoll for all of it without polling
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
    poll = BusyPoll(0.03)
    loop = asyncio.get_running_loop()
    first = loop.create_future()
    poll.watch(first)
    await asyncio.sleep(0.02)
    second = loop.create_future()
    poll.watch(second)
    await asyncio.sleep(0.02)  # 40 ms after the first, 20 after the second
    assert poll.spinning is loop
    for f in (first, second):
        f.set_result(None)
