"""Faults between two steps of the runtime pool (issue 17, points 2 and 3), against real
NATS and Valkey, the pool in process.

- The hand-off publish fails after READY (a nats-server restart): the session is
  retried, and ends as ERROR once its retries are spent, instead of staying READY with
  its lease renewed for ever.
- The pool dies between the INITIALIZING transition and taking the lease: the two are
  one registry step now, and a reaper gives any held-state session without a lease an
  expired one and ends or retries it.
- The pool is stopping when a run on its node ends: the wake-up that admits work waiting
  for a held place admits nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import nats.errors
import pytest
import redis.exceptions

from schemas import InitWork, Outcome, SessionState
from schemas import subjects as S
from services.common.bus import Bus
from services.common.registry import Registry
from services.node.harnesses import default_registry
from services.node.reaper import Reaper
from services.pool.config import PoolConfig
from services.pool.handlers import RuntimePool
from tests.helpers.node import task, wait_until

pytestmark = pytest.mark.asyncio
ST = SessionState
NODE = "faultnode"


@dataclass(frozen=True)
class HandOffLost(Bus):
    """The real bus, except that every READY hand-off publish times out (as it did
    while nats-server restarted)."""

    async def publish(self, subject, payload, *, msg_id=None, headers=None):
        if subject == S.sessions_ready(NODE):
            raise nats.errors.TimeoutError
        return await super().publish(subject, payload, msg_id=msg_id, headers=headers)


class Ack:
    """What the pool does with an init message it was handed (nothing to redeliver)."""

    acked = False

    async def ack(self) -> None:
        self.acked = True

    async def in_progress(self) -> None:
        pass


async def open_pool(
    nats_url,
    redis_url,
    tmp_path,
    bus_type=Bus,
    lease: float = 2.0,
    registry_type=Registry,
    **bounds: int,
):
    bus = await Bus.open(nats_url, "test-pool-faults")
    bus = bus_type(bus.nc, bus.js, publish_tries=2, publish_backoff=0.05)
    reg = registry_type.from_url(redis_url, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    cfg = PoolConfig(
        nats_url=nats_url,
        redis_url=redis_url,
        work_dir=str(tmp_path / "work"),
        node=NODE,
        lease_seconds=lease,
        **bounds,
    )
    return RuntimePool(bus, reg, cfg, default_registry())


async def close_pool(pool: RuntimePool) -> None:
    if pool._jobs:
        await asyncio.gather(*pool._jobs, return_exceptions=True)
    await pool.registry.close()
    await pool.bus.close()


async def registered(pool: RuntimePool, task_id: str, **spec) -> InitWork:
    _, (session,) = await pool.registry.create_task(task(task_id, 1, **spec))
    return InitWork(
        ts=time.time(), session_id=session.session_id, task_id=task_id, priority=0, attempt=0
    )


async def session_when(pool: RuntimePool, sid: str, ok, timeout: float, what: str):
    """The session once ``ok(session)`` holds."""

    async def check():
        s = await pool.registry.get_session(sid)
        return s if ok(s) else None

    return await wait_until(check, timeout, what)


async def test_a_lost_hand_off_is_retried_then_ended_never_held_ready(fresh_servers, tmp_path):
    pool = await open_pool(*fresh_servers, tmp_path, HandOffLost)
    try:
        item = await registered(pool, "handoff", infra_retries=1)
        sid = item.session_id
        assert await pool._admit(item, Ack())

        # before the fix: READY for ever ("INIT of ... failed", then renewed by the pool)
        await session_when(
            pool, sid, lambda s: s.attempt == 1 and s.state == ST.REGISTERED, 10,
            "the session retried after its hand-off failed",
        )  # fmt: skip
        again = InitWork(ts=time.time(), session_id=sid, task_id="handoff", priority=0, attempt=1)
        assert await pool._admit(again, Ack())

        s = await session_when(
            pool, sid, lambda s: s.state == ST.POSTRUN, 10,
            "the session ended once its retries were spent",
        )  # fmt: skip
        assert s.outcome == Outcome.ERROR and s.attempt == 1 and "init failed" in s.reason
        # the INIT job lets go of the session just after ending it (it held it till then)
        deadline = time.monotonic() + 10
        while sid in pool.initializing and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert sid not in pool.initializing
        await pool.renew_leases()  # a READY session it never handed off is not renewed
        assert await pool.registry.redis.zscore(S.KEY_LEASES, sid) is None
        assert pool.handed_off == set()
    finally:
        await close_pool(pool)


async def test_admission_takes_state_and_lease_in_one_step(fresh_servers, tmp_path):
    pool = await open_pool(*fresh_servers, tmp_path)
    try:
        item = await registered(pool, "atomic")

        async def dies(*args, **kwargs):  # the pool process dies right after admitting
            raise SystemExit("kill -9")

        pool.registry.hold = dies
        with contextlib.suppress(SystemExit):
            await pool._admit(item, Ack())
        s = await pool.registry.get_session(item.session_id)
        assert s.state == ST.INITIALIZING
        # before the fix: None (the lease was a second step, hold(), never taken)
        assert await pool.registry.redis.zscore(S.KEY_LEASES, item.session_id) is not None
    finally:
        for runtime in list(pool.initializing.values()):
            await runtime.cancel()
        await close_pool(pool)


async def test_reaper_ends_or_retries_held_sessions_that_have_no_lease(fresh_servers, tmp_path):
    pool = await open_pool(*fresh_servers, tmp_path)
    reg = pool.registry
    try:
        await pool.heartbeat()  # the node is known to the registry
        retry = await registered(pool, "orphan-retry")
        final = await registered(pool, "orphan-end", infra_retries=0)
        for item in (retry, final):  # what a crash between two steps left: no lease
            t = await reg.transition(item.session_id, ST.INITIALIZING, node=NODE)
            assert t.ok
        # 1 s (not 0.3): the first look must come within it of the transitions above,
        # which a loaded machine can stretch; over 1 s a fresh Valkey's uptime (whole
        # seconds) would hold the reaper back instead, and the check would prove nothing
        reaper = Reaper(reg, pool.bus, lambda *a: None, keep=lambda sid: False, orphan_after=1.0)
        assert await reaper.reap() == 0  # too fresh to call orphans yet
        await asyncio.sleep(1.1)
        assert await reaper.reap() == 2
        r, f = await reg.get_sessions([retry.session_id, final.session_id])
        assert (r.state, r.attempt) == (ST.REGISTERED, 1)  # a lost holder: the system's fault
        assert (f.state, f.outcome) == (ST.POSTRUN, Outcome.ERROR)
        assert "holder lost" in f.reason
        assert await reaper.reap() == 0
    finally:
        await close_pool(pool)


async def test_an_earlier_attempts_init_work_redelivered_is_not_admitted(fresh_servers, tmp_path):
    # A pool killed mid-INIT leaves its attempt-0 message unacked; the reaper retries the
    # session as attempt 1. The attempt-0 message, redelivered, must not start attempt 0
    # again (its hand-off id `ready:<sid>:0` is then deduplicated: nobody would run it).
    pool = await open_pool(*fresh_servers, tmp_path)
    try:
        item = await registered(pool, "stale")
        sid = item.session_id
        assert (await pool.registry.transition(sid, ST.INITIALIZING, node=NODE)).ok
        assert (await pool.registry.transition(sid, ST.REGISTERED, attempt=1)).ok
        assert not await pool._admit(item, Ack())  # attempt 0's work
        s = await pool.registry.get_session(sid)
        assert (s.state, s.attempt) == (ST.REGISTERED, 1)
    finally:
        await close_pool(pool)


class RegistryBlinks(Registry):
    """The real registry, except that its first two admission counts fail as they do
    while Valkey restarts ("Connection closed by server.")."""

    blinks = 2

    async def node_stage_counts(self, node, states):
        if self.blinks:
            self.blinks -= 1
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return await super().node_stage_counts(node, states)


async def test_a_registry_blip_during_init_is_run_again_in_place(fresh_servers, tmp_path):
    """A fault of the system during INIT re-runs it in the same attempt: before, each
    blip used one of the session's ``infra_retries`` and a third ended it ERROR (the
    chaos test's pool row, CI of 2026-12-02)."""
    pool = await open_pool(*fresh_servers, tmp_path, registry_type=RegistryBlinks)
    try:
        item = await registered(pool, "blip", infra_retries=0)
        sid = item.session_id
        assert await pool._admit(item, Ack())

        s = await session_when(
            pool, sid, lambda s: s.state == ST.READY and sid in pool.handed_off, 20,
            "the session READY and handed off",
        )  # fmt: skip
        assert s.attempt == 0 and pool.registry.blinks == 0
    finally:
        await close_pool(pool)


async def test_a_stopping_pool_admits_nothing_when_a_run_ends(fresh_servers, tmp_path):
    """A run holds the node's one place, so queued work waits for it; the pool is then
    stopped, and the run's end (the event that wakes admission) starts no INIT (before:
    it admitted the work into a pool on its way out)."""
    pool = await open_pool(*fresh_servers, tmp_path, max_run=1, ready_buffer=0)
    reg = pool.registry
    ended = await pool.bus.nc.subscribe(S.session_event(ST.POSTRUN))
    try:
        run = await registered(pool, "the-run")
        for state in (ST.INITIALIZING, ST.READY, ST.RUNNING):
            assert (await reg.transition(run.session_id, state, node=NODE)).ok
        waiting, msg = await registered(pool, "waiting"), Ack()
        pool.queue.push(waiting.priority, (waiting, msg))
        assert await pool.dispatch() == 0 and pool._waits_for_run  # held by the run

        pool.stop()
        assert (await reg.transition(run.session_id, ST.POSTRUN)).ok
        await pool.on_left_ready(await ended.next_msg(timeout=5))
        s = await reg.get_session(waiting.session_id)
        assert s.state == ST.REGISTERED and not pool._jobs  # before the fix: INITIALIZING
        assert len(pool.queue) == 1 and not msg.acked  # left to be redelivered
    finally:
        await ended.unsubscribe()
        await close_pool(pool)
