"""A registry change whose message the bus cannot take keeps that message in the outbox,
and the relay publishes it once the bus is back (issue 33: a NATS outage of 30 s left
retried sessions REGISTERED with no INIT work until their deadline).

Real nats-server and Valkey of the test's own: NATS is stopped for the change and
started again on its same port and store.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from infra import localservers
from schemas import InitWork, SessionFinished, SessionState, TaskRequest, decode, encode
from schemas import subjects as S
from services.common import outbox
from services.common.finish import fail_before_run
from services.common.host import ServiceHost
from services.common.registry import Outgoing
from services.common.settings import ServiceSettings
from services.node.reaper import retry_session
from services.scheduler.config import SchedulerConfig
from services.scheduler.handlers import Scheduler
from tests.helpers.node import wait_until

ST = SessionState
pytestmark = pytest.mark.timeout(180)


class Servers:
    def __init__(self, tmp_path) -> None:
        self.dir = tmp_path
        self.nats_port, redis_port = localservers.free_port(), localservers.free_port()
        self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        self.nats = localservers.start_nats(self.nats_port, tmp_path / "nats")
        self.valkey = localservers.start_valkey(redis_port, tmp_path / "valkey")

    def nats_down(self) -> None:
        localservers.stop_process(self.nats.pid)

    def nats_up(self) -> None:
        self.nats = localservers.start_nats(self.nats_port, self.dir / "nats")

    def stop(self) -> None:
        for proc in (self.nats, self.valkey):
            with contextlib.suppress(Exception):
                localservers.stop_process(proc.pid)


@pytest.fixture
async def stack(tmp_path):
    servers = Servers(tmp_path)
    host = ServiceHost("outbox-test", ServiceSettings(nats_url=servers.nats_url,
                                                      redis_url=servers.redis_url))  # fmt: skip
    await host.start()
    # a quick give-up, so the test need not wait out the ~8 s of tries of 10 s each
    js = host.bus.nc.jetstream(timeout=2)
    host.bus = dataclasses.replace(host.bus, js=js, publish_tries=2, publish_backoff=0.05)
    host.registry.publish = host.publish
    try:
        yield servers, host
    finally:
        with contextlib.suppress(Exception):  # a failed test may leave NATS down
            await host.stop()
        servers.stop()


async def registered(host, task_id: str, n: int = 1):
    spec = TaskRequest(task_id=task_id, instruction="x", num_samples=n)
    _, sessions = await host.registry.create_task(spec)
    return sessions


async def relayed(host, n: int) -> None:
    """The relay, round after round (the bus reconnecting meanwhile), until the outbox is
    empty; ``n`` messages published in all."""
    sent = 0

    async def empty() -> bool:
        nonlocal sent
        with contextlib.suppress(Exception):
            sent += await outbox.relay(host.registry, host.bus, grace=0)
        return await host.registry.outbox_size() == 0

    await wait_until(empty, 60, "the outbox relayed")
    assert sent == n


async def last_on(host, stream: str, subject: str) -> bytes:
    msg = await host.bus.js.get_last_msg(stream, subject)
    return msg.data


async def test_a_retry_during_a_nats_outage_still_queues_its_init_work(stack):
    servers, host = stack
    reg = host.registry
    [s] = await registered(host, "obx-retry")
    assert (await reg.transition(s.session_id, ST.INITIALIZING, expect_attempt=0)).ok
    session = await reg.get_session(s.session_id)
    servers.nats_down()
    # before the outbox: nats.errors.TimeoutError out of Registry._emit, the session
    # REGISTERED under attempt 1 and no INIT work anywhere
    assert await asyncio.wait_for(retry_session(reg, host.bus, session, "init failed"), 60)
    now = await reg.get_session(s.session_id)
    assert (now.state, now.attempt) == (ST.REGISTERED, 1)
    # the INIT work and the REGISTERED state event wait in the outbox
    assert await reg.outbox_size() == 2
    servers.nats_up()
    await relayed(host, 2)
    work = decode(await last_on(host, S.STREAM_SESSIONS, S.SESSIONS_INIT), InitWork)
    assert (work.session_id, work.attempt) == (s.session_id, 1)


async def test_a_finish_during_a_nats_outage_reaches_the_builder_later(stack):
    servers, host = stack
    reg = host.registry
    [s] = await registered(host, "obx-finish")
    servers.nats_down()
    assert await asyncio.wait_for(
        fail_before_run(reg, host.bus, s, "deadline passed", [ST.REGISTERED]), 60
    )
    assert (await reg.get_session(s.session_id)).state == ST.POSTRUN
    servers.nats_up()
    await relayed(host, 2)  # the finish event and the POSTRUN state event
    done = decode(await last_on(host, S.STREAM_SESSIONS, S.SESSIONS_FINISHED), SessionFinished)
    assert (done.session_id, done.attempt, done.reason) == (s.session_id, 0, "deadline passed")


async def test_a_task_accepted_during_a_nats_outage_is_served_after_it(stack):
    servers, host = stack
    sched = Scheduler(host.bus, host.registry, SchedulerConfig(nats_url=servers.nats_url,
                                                               redis_url=servers.redis_url))  # fmt: skip
    servers.nats_down()
    spec = TaskRequest(task_id="obx-accept", instruction="x", num_samples=3)
    # before the outbox: nats.errors.TimeoutError, with the task registered and no work
    sessions = await asyncio.wait_for(sched.accept(spec), 60)
    assert [s.state for s in sessions] == [ST.REGISTERED] * 3
    servers.nats_up()
    await relayed(host, 4)  # three INIT works and the TaskAccepted event
    info = await host.bus.js.stream_info(S.STREAM_SESSIONS, subjects_filter=S.SESSIONS_INIT)
    assert info.state.subjects == {S.SESSIONS_INIT: 3}


async def test_a_kept_message_outlives_its_publisher(stack):
    """The change keeps its message in the same step: a changer that dies right after
    it (no publish, no mark) still has it relayed."""
    _, host = stack
    reg = host.registry
    [s] = await registered(host, "obx-crash")
    work = InitWork(ts=0.0, session_id=s.session_id, task_id="obx-crash", priority=0, attempt=1)
    out = Outgoing(S.SESSIONS_INIT, encode(work), f"init:{s.session_id}:1")
    assert (await reg.transition(s.session_id, ST.INITIALIZING, outbox=out)).ok
    # not yet due: the changer's own publish goes first
    assert await outbox.relay(reg, host.bus) == 0
    await relayed(host, 1)
    assert decode(await last_on(host, S.STREAM_SESSIONS, S.SESSIONS_INIT), InitWork) == work


async def test_a_refused_transition_keeps_nothing(stack):
    _, host = stack
    reg = host.registry
    [s] = await registered(host, "obx-refused")
    out = Outgoing(S.SESSIONS_INIT, b"{}", f"init:{s.session_id}:9")
    assert not (await reg.transition(s.session_id, ST.RUNNING, outbox=out)).ok
    assert await reg.outbox_size() == 0
