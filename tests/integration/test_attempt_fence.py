"""A holder cut off past its lease comes back after its session was retried elsewhere:
finishing its old attempt must not move the new attempt to POSTRUN (found by the
multi-host test, tests/cluster: sessions stuck in POSTRUN, their builder skipping the
old attempt's SessionFinished while the new attempt's run could no longer finish), and
no step before RUNNING may act on the new attempt either: the pool's INIT -> READY, its
handling of a failed INIT, a reaper's retry, the executor's READY -> RUNNING."""

import asyncio
import math
import time

import pytest

from schemas import Artifacts, Outcome, ReadyWork, SessionState, encode
from schemas import subjects as S
from services.common.finish import finish_session
from services.common.registry import Registry
from services.executor.config import ExecutorConfig
from services.executor.handlers import Executor
from services.node.harnesses import default_registry
from services.node.reaper import retry_session
from tests.helpers.node import wait_until
from tests.helpers.stack import running_session
from tests.integration.test_pool_faults import NODE, close_pool, open_pool, registered

ST = SessionState


async def test_an_old_attempts_finish_leaves_the_new_attempt_running(redis_client, bus):
    reg = Registry(redis_client)
    (old,) = await running_session(reg, "fence-1")  # attempt 0, RUNNING on node0
    # the lease was lost: the reaper retried it (attempt 1) and it runs again elsewhere
    sid = old.session_id
    assert (await reg.transition(sid, SessionState.REGISTERED, attempt=1, node=None)).ok
    for st in (SessionState.INITIALIZING, SessionState.READY, SessionState.RUNNING):
        assert (await reg.transition(sid, st, node="node1")).ok
    done = await finish_session(reg, bus, old, 0, Outcome.COMPLETED, None, Artifacts(), None)
    assert done is False
    now = await reg.get_session(sid)
    assert (now.state, now.attempt, now.node) == (SessionState.RUNNING, 1, "node1")
    new = await reg.get_session(sid)
    assert await finish_session(reg, bus, new, 1, Outcome.COMPLETED, None, Artifacts(), None)
    assert (await reg.get_session(sid)).state == SessionState.POSTRUN


# -- the steps before RUNNING: a pool cut off mid-INIT, back after the session's lease
# lapsed and it was retried (attempt 1), now INITIALIZING on another node -------------


async def _retried_elsewhere(pool, task_id: str):
    """Attempt 0 admitted on the pool's node, its lease lapsed: a reaper retried it and
    node1's pool took attempt 1. Returns the attempt-0 init work the stale pool holds."""
    item = await registered(pool, task_id)
    sid, reg = item.session_id, pool.registry
    assert (await reg.transition(sid, ST.INITIALIZING, node=NODE)).ok
    assert (await reg.transition(sid, ST.REGISTERED, attempt=1, node=None)).ok
    assert (await reg.transition(sid, ST.INITIALIZING, node="node1")).ok
    return item


async def _untouched(reg: Registry, sid: str) -> None:
    now = await reg.get_session(sid)
    assert (now.state, now.attempt, now.node) == (ST.INITIALIZING, 1, "node1")
    assert await _runtime_id(reg, sid) is None


async def _runtime_id(reg: Registry, sid: str) -> bytes | None:
    return await reg.redis.hget(S.key_session(sid), "runtime_id")


async def test_a_stale_pools_init_does_not_make_the_new_attempt_ready(fresh_servers, tmp_path):
    pool = await open_pool(*fresh_servers, tmp_path)
    try:
        item = await _retried_elsewhere(pool, "fence-ready")
        # before the fix: "ready", the session READY under attempt 1 with this pool's
        # sandbox (node1's own INIT then found it READY and dropped its sandbox)
        assert await pool._init_once(item, fresh=True) == "cancelled"
        await _untouched(pool.registry, item.session_id)
        assert pool.handed_off == set()
    finally:
        await close_pool(pool)


async def test_a_stale_pools_failed_init_leaves_the_new_attempt_alone(fresh_servers, tmp_path):
    pool = await open_pool(*fresh_servers, tmp_path)
    try:
        item = await _retried_elsewhere(pool, "fence-init-failed")
        # before the fix: the stale holder's failure ended attempt 1 (ERROR, or retried)
        await pool._init_failed(item, None, RuntimeError("sandbox gone"))
        await _untouched(pool.registry, item.session_id)
    finally:
        await close_pool(pool)


async def test_a_reaper_reading_an_old_attempt_does_not_retry_the_new_one(fresh_servers, tmp_path):
    pool = await open_pool(*fresh_servers, tmp_path)
    try:
        item = await registered(pool, "fence-reaper")
        sid, reg = item.session_id, pool.registry
        assert (await reg.transition(sid, ST.INITIALIZING, node=NODE)).ok
        stale = await reg.get_session(sid)  # two reapers read attempt 0; one retries it
        assert await retry_session(reg, pool.bus, stale, "holder lost")
        assert (await reg.transition(sid, ST.INITIALIZING, node="node1")).ok
        # before the fix: the second one, on what it read, retried attempt 1 again
        assert not await retry_session(reg, pool.bus, stale, "holder lost")
        await _untouched(reg, sid)
    finally:
        await close_pool(pool)


class Delivery:  # a READY hand-off as the executor's consumer passes it
    def __init__(self, work: ReadyWork) -> None:
        self.data = encode(work)


async def test_a_stale_ready_hand_off_does_not_run_the_new_attempt(fresh_servers, tmp_path):
    """The executor's READY -> RUNNING is fenced by attempt (since the admission change,
    dc00218): attempt 0's hand-off, redelivered after the session was retried and is
    READY again under attempt 1, neither runs nor takes it."""
    pool = await open_pool(*fresh_servers, tmp_path)
    nats_url, redis_url = fresh_servers
    cfg = ExecutorConfig(
        nats_url=nats_url, redis_url=redis_url, work_dir=str(tmp_path / "work"), node=NODE
    )
    executor = Executor(pool.bus, pool.registry, cfg, default_registry())
    try:
        item = await registered(pool, "fence-run")
        sid, reg = item.session_id, pool.registry
        for st in (ST.INITIALIZING, ST.READY):
            assert (await reg.transition(sid, st, node=NODE, runtime_id="rt-0")).ok
        assert (await reg.transition(sid, ST.REGISTERED, attempt=1, node=None)).ok
        for st in (ST.INITIALIZING, ST.READY):
            assert (await reg.transition(sid, st, node=NODE, runtime_id="rt-1")).ok
        old = ReadyWork(
            ts=time.time(), session_id=sid, task_id="fence-run", node=NODE, runtime_id="rt-0"
        )
        await executor.on_ready(Delivery(old))
        now = await reg.get_session(sid)
        assert (now.state, now.attempt) == (ST.READY, 1)
        assert await _runtime_id(reg, sid) == b"rt-1"
        assert executor.running == {}
    finally:
        await close_pool(pool)


async def test_a_retry_shuts_the_old_attempts_harness_out(fresh_servers, tmp_path):
    """The proxy serves a token while its session is RUNNING, whichever attempt runs: the
    retry gives the next attempt a new token and kills the old one, so the old attempt's
    harness (on a host cut off past its lease, back while attempt 1 runs) is refused, not
    captured as attempt 1's (found by tests/cluster: trajectories of 3 and 4 calls where
    each attempt made 2)."""
    pool = await open_pool(*fresh_servers, tmp_path)
    try:
        item = await registered(pool, "fence-token")
        sid, reg = item.session_id, pool.registry
        assert (await reg.transition(sid, ST.INITIALIZING, node=NODE)).ok
        old = await reg.get_session(sid)
        assert (await reg.session_by_token(old.token)).session_id == sid
        assert await retry_session(reg, pool.bus, old, "holder lost")
        new = await reg.get_session(sid)
        assert new.token != old.token and new.attempt == 1
        for st in (ST.INITIALIZING, ST.READY, ST.RUNNING):
            assert (await reg.transition(sid, st, node="node1")).ok
        assert await reg.session_by_token(old.token) is None  # before the fix: the session
        assert (await reg.session_by_token(new.token)).session_id == sid
        ttl = await reg.redis.expiretime(S.key_token(new.token))
        assert ttl == math.ceil(new.deadline) + 3600  # as the first token's
    finally:
        await close_pool(pool)


async def test_a_stale_executors_end_leaves_the_new_holders_lease(fresh_servers, tmp_path):
    """An executor whose run outlived its lease (cut off) ends it after the session was
    retried and taken by node1's pool: it must drop only its own lease, not node1's
    (before the fix a reaper then found the new attempt held by nobody and retried it)."""
    pool = await open_pool(*fresh_servers, tmp_path)
    nats_url, redis_url = fresh_servers
    cfg = ExecutorConfig(
        nats_url=nats_url, redis_url=redis_url, work_dir=str(tmp_path / "work"), node=NODE
    )
    executor = Executor(pool.bus, pool.registry, cfg, default_registry())
    try:
        item = await registered(pool, "fence-lease", agent={"command": "sleep 1"})
        sid, reg = item.session_id, pool.registry
        assert (await reg.transition(sid, ST.INITIALIZING, node=NODE)).ok
        assert await pool._init_once(item, fresh=True) == "ready"
        work = ReadyWork(
            ts=time.time(), session_id=sid, task_id="fence-lease", node=NODE,
            runtime_id=pool.initializing[sid].runtime_id,
        )  # fmt: skip
        run = asyncio.create_task(executor.on_ready(Delivery(work)))
        await wait_until(lambda: sid in executor.running, 10, "the run started")
        # meanwhile its lease lapsed: retried, and node1's pool took attempt 1
        t = await reg.transition(sid, ST.REGISTERED, attempt=1, node=None, runtime_id=None)
        assert t.ok
        t = await reg.transition(sid, ST.INITIALIZING, node="node1", lease=("pool:node1", 60))
        assert t.ok
        await asyncio.wait_for(run, 30)
        await _untouched(reg, sid)
        assert await reg.redis.zscore(S.KEY_LEASES, sid) is not None  # before: None
    finally:
        await close_pool(pool)


async def test_a_stale_holder_cannot_renew_the_new_attempts_lease(fresh_servers, tmp_path):
    """Renewing is not taking: an executor back from a cut renews the sessions it still
    runs, and one retried meanwhile is the new holder's (before the fix its renewal
    made it the owner again, and its run's end then dropped the new attempt's lease)."""
    pool = await open_pool(*fresh_servers, tmp_path)
    try:
        item = await registered(pool, "fence-renew")
        sid, reg = item.session_id, pool.registry
        t = await reg.transition(sid, ST.INITIALIZING, node=NODE, lease=("executor:old", 60))
        assert t.ok and await reg.hold([sid], "executor:old", 60) == []
        assert await retry_session(reg, pool.bus, await reg.get_session(sid), "holder lost")
        t = await reg.transition(sid, ST.INITIALIZING, node="node1", lease=("pool:node1", 60))
        assert t.ok
        assert await reg.hold([sid], "executor:old", 600) == [sid]
        assert await reg.redis.hget(S.key_session(sid), "lease_owner") == b"pool:node1"
        assert await reg.redis.zscore(S.KEY_LEASES, sid) < time.time() + 120
    finally:
        await close_pool(pool)


async def test_a_hand_off_the_registry_refused_is_run_when_redelivered(fresh_servers, tmp_path):
    """READY -> RUNNING refused by the registry (NOREPLICAS: a Valkey failover under
    min-replicas-to-write) fails the delivery; its redelivery must start the run, not be
    taken for a duplicate of a run that never started (before the fix the session
    waited READY until its deadline: tests/cluster, 6 sessions ERROR)."""
    import redis.exceptions

    pool = await open_pool(*fresh_servers, tmp_path)
    nats_url, redis_url = fresh_servers
    cfg = ExecutorConfig(
        nats_url=nats_url, redis_url=redis_url, work_dir=str(tmp_path / "work"), node=NODE
    )
    executor = Executor(pool.bus, pool.registry, cfg, default_registry())
    reg = pool.registry
    try:
        item = await registered(pool, "refused-run", agent={"command": "true"})
        sid = item.session_id
        assert (await reg.transition(sid, ST.INITIALIZING, node=NODE)).ok
        assert await pool._init_once(item, fresh=True) == "ready"
        work = ReadyWork(
            ts=time.time(), session_id=sid, task_id="refused-run", node=NODE,
            runtime_id=pool.initializing[sid].runtime_id,
        )  # fmt: skip
        await reg.redis.config_set("min-replicas-to-write", 1)  # no replica: NOREPLICAS
        try:
            with pytest.raises(redis.exceptions.ResponseError, match="NOREPLICAS"):
                await executor.on_ready(Delivery(work))
        finally:
            await reg.redis.config_set("min-replicas-to-write", 0)
        assert executor.running == {}
        await executor.on_ready(Delivery(work))  # the redelivery
        assert (await reg.get_session(sid)).state in (ST.POSTRUN, ST.BUILDING)
    finally:
        await close_pool(pool)


async def test_a_holders_release_of_an_old_attempt_leaves_its_lease_on_the_next(
    fresh_servers, tmp_path
):
    """One holder may come to hold the next attempt too (a pool back from a cut admits
    it while the old INIT unwinds): releasing with the old attempt leaves the new
    attempt's lease; with the session's attempt, or none named, it drops it."""
    pool = await open_pool(*fresh_servers, tmp_path)
    try:
        item = await registered(pool, "fence-release")
        sid, reg = item.session_id, pool.registry
        t = await reg.transition(sid, ST.INITIALIZING, node=NODE, lease=(pool.owner, 60))
        assert t.ok
        assert await retry_session(reg, pool.bus, await reg.get_session(sid), "holder lost")
        t = await reg.transition(sid, ST.INITIALIZING, node=NODE, lease=(pool.owner, 60))
        assert t.ok
        await reg.release(sid, pool.owner, 0)
        assert await reg.redis.zscore(S.KEY_LEASES, sid) is not None  # before: dropped
        await reg.release(sid, "pool:other", 1)
        assert await reg.redis.zscore(S.KEY_LEASES, sid) is not None  # not its holder
        await reg.release(sid, pool.owner, 1)
        assert await reg.redis.zscore(S.KEY_LEASES, sid) is None
        t = await reg.transition(sid, ST.READY, lease=(pool.owner, 60))
        assert t.ok
        await reg.release(sid, pool.owner)  # no attempt named: as before
        assert await reg.redis.zscore(S.KEY_LEASES, sid) is None
    finally:
        await close_pool(pool)
