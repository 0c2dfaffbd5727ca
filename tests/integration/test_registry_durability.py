"""The registry survives a crash of Valkey, and a service notices one that did not.

- The dev stack's Valkey (``localservers.start_valkey``) keeps an append-only file:
  ``kill -9`` and a restart on the same directory keeps every session.
- A registry that lost its state anyway (a flush, a server without persistence) stops
  every service loudly: each one watches the registry's epoch marker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import redis.asyncio as aioredis

from infra import localservers
from schemas import TaskRequest
from schemas import subjects as S
from services.common.registry import Registry
from tests.helpers.procs import ServiceProcess

pytestmark = pytest.mark.asyncio


async def test_kill_9_of_valkey_keeps_every_session(tmp_path):
    port = localservers.free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = localservers.start_valkey(port, tmp_path / "valkey")
    try:
        reg = Registry.from_url(url)
        epoch = await reg.ensure_epoch()
        _, sessions = await reg.create_task(
            TaskRequest(task_id="durable", instruction="x", num_samples=8)
        )
        await reg.close()
        os.killpg(proc.pid, signal.SIGKILL)  # no shutdown: no final save
        proc.wait(10)
        proc = localservers.start_valkey(port, tmp_path / "valkey")
        reg = Registry.from_url(url)
        kept = await reg.task_sessions("durable")
        assert [s.token for s in kept] == [s.token for s in sessions]
        assert await reg.epoch() == epoch
        await reg.close()
    finally:
        localservers.stop_process(proc.pid)


async def test_epoch_is_written_once_by_whoever_comes_first(redis_url):
    regs = [Registry.from_url(redis_url) for _ in range(4)]
    epochs = await asyncio.gather(*(r.ensure_epoch() for r in regs))
    assert len(set(epochs)) == 1 and epochs[0] == await regs[0].epoch()
    for r in regs:
        await r.close()


async def test_a_service_stops_loudly_when_the_registry_loses_its_state(fresh_servers, tmp_path):
    nats_url, redis_url = fresh_servers
    cfg = {"nats_url": nats_url, "redis_url": redis_url, "registry_check_seconds": 0.2}
    sched = ServiceProcess("services.scheduler.main:create_app", cfg, tmp_path).start()
    try:
        redis = aioredis.from_url(redis_url)
        assert await redis.exists(S.KEY_REGISTRY_EPOCH)
        await redis.flushall()  # what a restart without persistence looks like
        await redis.aclose()
        deadline = time.monotonic() + 20
        while sched.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert sched.proc.poll() is not None, "the scheduler kept running on an empty registry"
        assert "the registry lost its state" in sched.log.read_text()
    finally:
        sched.kill()


async def test_a_renewal_writes_no_fragment_of_a_session_the_registry_lost(redis_url):
    """Issue 17.1: after Valkey came back empty the executor's renewals re-created
    ``polar:session:*`` hashes holding only ``lease_owner``, before anything noticed."""
    reg = Registry.from_url(redis_url)
    try:
        _, sessions = await reg.create_task(
            TaskRequest(task_id="fragments", instruction="x", num_samples=2)
        )
        kept, lost = (s.session_id for s in sessions)
        for sid in (kept, lost):  # both held (as a transition with a lease leaves them)
            await reg.redis.hset(S.key_session(sid), "lease_owner", "holder")
        await reg.redis.delete(S.key_session(lost))  # gone, as in a registry that lost it
        assert await reg.hold([kept, lost], "holder", 30.0) == [lost]  # not held any more
        assert not await reg.redis.exists(S.key_session(lost))  # no fragment
        assert await reg.redis.zscore(S.KEY_LEASES, lost) is None
        assert await reg.redis.zscore(S.KEY_LEASES, kept) is not None
        assert await reg.redis.hget(S.key_session(kept), "lease_owner") == b"holder"
    finally:
        await reg.close()
