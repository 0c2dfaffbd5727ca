"""A plugin that kills its service's process is quarantined, not crash-looped on (issue 33:
an evaluator that aborted died 9 times over 5.5 minutes, and its session stayed
EVALUATING past its deadline with no trajectory).

The evaluator runs as a real process, started again whenever it dies, as a supervisor
would. The session whose evaluator ends the process is redelivered after each death, runs
alone after three, and after its fourth death is not run again: it is delivered with an
error result saying why, its session ends, and the message is dead-lettered; the other
sessions are evaluated, before and after, by the same service."""

from __future__ import annotations

import asyncio

import pytest

from schemas import EvaluatorSpec, SessionState, TaskRequest
from schemas import subjects as S
from services.common.registry import Registry
from tests.helpers.procs import ServiceExited, ServiceProcess
from tests.unit.evaluators.sessions import announce, delivered, new_sessions, remove_built, unscored

pytestmark = pytest.mark.asyncio
KILLER = "tests.helpers.killer_plugins:ExitsProcess"
AFTER = 4  # services.common.quarantine.QUARANTINE_AFTER
EVALUATING = SessionState.EVALUATING


@pytest.fixture
async def registry(redis_client):
    return Registry(redis_client)


@pytest.fixture(autouse=True)
async def _clean_work_queue(bus):
    yield
    await remove_built(bus, "qr-")


def task(task_id: str, n: int = 1, evaluator: str = "session_completed") -> TaskRequest:
    return TaskRequest(
        task_id=task_id, instruction="x", num_samples=n, evaluator=EvaluatorSpec(name=evaluator)
    )


async def settled(registry: Registry, sids: list[str]) -> bool:
    return EVALUATING not in {s.state for s in await registry.get_sessions(sids)}


async def test_an_evaluator_that_kills_its_process_is_quarantined_and_the_rest_served(
    bus, registry, nats_url, redis_url, state_dir
):
    (killer,) = await new_sessions(registry, task("qr-kill", evaluator=KILLER))
    good = await new_sessions(registry, task("qr-good", 3))
    dlq = await bus.nc.subscribe(S.dead_letter(S.STREAM_SESSIONS))
    await announce(bus, unscored(killer, "qr-kill"))
    for sid in good:
        await announce(bus, unscored(sid, "qr-good"))
    cfg = {
        "nats_url": nats_url,
        "redis_url": redis_url,
        "work_dir": str(state_dir / "evwork-quarantine"),
        "ack_wait_seconds": 1.0,  # an unsettled message comes back a second after a death
        "concurrency": 2,
    }
    proc = ServiceProcess("services.evaluator.main:create_app", cfg, state_dir / "logs")
    deaths = 0
    try:
        async with asyncio.timeout(300):  # a bound for a hang, not a margin: deaths count
            while not await settled(registry, [killer, *good]):
                if proc.proc is None or proc.proc.poll() is not None:
                    if proc.proc is not None:
                        deaths += 1
                    assert deaths <= AFTER + 1, f"the evaluator died {deaths} times"
                    try:
                        await asyncio.to_thread(proc.start)
                    except ServiceExited:  # died again before it was healthy
                        proc.proc = None
                        deaths += 1
                    continue
                await asyncio.sleep(0.1)
        assert deaths == AFTER
        # the killer's session ended with the reason, and its trajectory was delivered
        s = await registry.get_session(killer)
        why = (
            "quarantined: the evaluator's process died 4 times while evaluating it with "
            f"{KILLER!r}; not run again"
        )
        assert (s.state, s.eval_status, s.eval_reason) == (SessionState.COMPLETED, "error", why)
        (t,) = await delivered(bus, "qr-kill")
        assert (t.eval_status, t.eval_reason, t.reward) == ("error", why, None)
        dead = await dlq.next_msg(timeout=10)
        assert dead.headers["Polar-Reason"] == (
            "quarantined: its process died 4 times while handling it, the last time running alone"
        )
        # the others were evaluated, and the same process goes on serving
        assert {(x.state, x.reward) for x in await registry.task_sessions("qr-good")} == {
            (SessionState.COMPLETED, 1.0)
        }
        pid = proc.proc.pid
        (after,) = await new_sessions(registry, task("qr-after"))
        await announce(bus, unscored(after, "qr-after"))
        async with asyncio.timeout(60):
            while not await settled(registry, [after]):
                await asyncio.sleep(0.1)
        assert (await registry.get_session(after)).reward == 1.0
        assert proc.proc.poll() is None and proc.proc.pid == pid
    finally:
        proc.stop()
        await dlq.unsubscribe()


async def test_a_cancel_ends_a_session_whose_evaluation_keeps_killing_the_evaluator(
    bus, registry, redis_client, nats_url, redis_url, state_dir
):
    """A session past its run is left to deliver when its task is cancelled; one whose
    evaluation died with the evaluator is not evaluated again once a cancel was asked:
    it is delivered with the cancel as its reason at its next delivery (issue 33: a
    cancel did not stop the crash loop)."""
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.handlers import Scheduler

    (killer,) = await new_sessions(registry, task("qr-cancel", evaluator=KILLER))
    await announce(bus, unscored(killer, "qr-cancel"))
    cfg = {
        "nats_url": nats_url,
        "redis_url": redis_url,
        "work_dir": str(state_dir / "evwork-quarantine-cancel"),
        "ack_wait_seconds": 1.0,
    }
    proc = ServiceProcess("services.evaluator.main:create_app", cfg, state_dir / "logs")
    scheduler = Scheduler(bus, registry, SchedulerConfig())
    deaths, cancelled = 0, False
    try:
        async with asyncio.timeout(300):
            while not await settled(registry, [killer]):
                if proc.proc is None or proc.proc.poll() is not None:
                    if proc.proc is not None:
                        deaths += 1
                    if deaths and not cancelled:  # it died once: the task is cancelled
                        assert await scheduler.cancel_task("qr-cancel", "stop it") == 0
                        cancelled = True
                    assert deaths <= 2, f"the evaluator died {deaths} times"
                    try:
                        await asyncio.to_thread(proc.start)
                    except ServiceExited:
                        proc.proc = None
                        deaths += 1
                    continue
                await asyncio.sleep(0.1)
        assert deaths == 1
        why = "quarantined: cancelled (stop it) after its evaluation died with the evaluator"
        s = await registry.get_session(killer)
        assert (s.eval_status, s.eval_reason) == ("error", why)
        (t,) = await delivered(bus, "qr-cancel")
        assert t.eval_reason == why
    finally:
        proc.stop()
