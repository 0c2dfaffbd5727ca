"""The clustered backbone on loopback: a 3-node JetStream cluster with R3 streams that a
client rides across the loss of the server it is connected to, and a Valkey primary +
replica under Sentinel that the registry (redis-py) and the proxy's own RESP client
both follow through a failover."""

from __future__ import annotations

import asyncio
import time

import pytest

from infra import clusterservers as cs
from infra.localservers import free_port
from proxy.io.resp import RedisUnavailable, Resp
from schemas import SessionState, TaskRequest
from schemas import subjects as S
from services.common.bus import Bus, ensure_consumer, work_consumer
from services.common.registry import Registry

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def nats_cluster(tmp_path):
    nodes = [cs.NatsNode(f"n{i}", "127.0.0.1", free_port(), free_port()) for i in range(3)]
    servers = cs.nats_cluster(nodes, tmp_path / "nats")
    try:
        for s in servers:
            s.start()
        yield nodes, servers
    finally:
        for s in servers:
            s.kill()


async def _retrying(make, timeout: float = 30.0):
    """``await make()``, again on errors while the cluster elects new leaders."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await make()
        except Exception:  # noqa: BLE001 - JetStream answers 503/timeouts during election
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_r3_streams_survive_losing_the_connected_server(nats_cluster):
    nodes, servers = nats_cluster
    bus = await _retrying(lambda: Bus.open(cs.nats_url(nodes), "cluster-test", replicas=3))
    try:
        info = await bus.js.stream_info(S.STREAM_TRAJECTORIES)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        subject = "polar.trajectories.cluster-test"
        for i in range(50):
            await _retrying(lambda i=i: bus.publish(subject, b"%d" % i, msg_id=f"m{i}"))
        connected = bus.nc.connected_url.port
        victim = next(s for s in servers if s.port == connected)
        victim.kill()
        started = time.monotonic()
        for i in range(50, 100):
            await _retrying(lambda i=i: bus.publish(subject, b"%d" % i, msg_id=f"m{i}"))
        recovered = time.monotonic() - started
        assert bus.nc.connected_url.port != connected
        await _retrying(
            lambda: ensure_consumer(
                bus.js, S.STREAM_TRAJECTORIES, work_consumer("cluster-read", subject)
            )
        )
        sub = await bus.js.pull_subscribe_bind("cluster-read", S.STREAM_TRAJECTORIES)
        seen: list[int] = []
        while len(seen) < 100:
            for msg in await _retrying(lambda: sub.fetch(100, timeout=5)):
                seen.append(int(msg.data))
                await msg.ack()
        assert sorted(seen) == list(range(100)), "each message exactly once"
        print(f"publishing resumed {recovered:.2f}s after the connected server died")
    finally:
        await bus.close()


@pytest.fixture
def sentinel_pair(tmp_path):
    primary = cs.valkey("primary", "127.0.0.1", free_port(), tmp_path)
    replica = cs.valkey(
        "replica", "127.0.0.1", free_port(), tmp_path, replica_of=("127.0.0.1", primary.port)
    )
    sentinel = cs.sentinel(
        "sentinel", "127.0.0.1", free_port(), ("127.0.0.1", primary.port), tmp_path
    )
    started = []
    try:
        for s in (primary, replica, sentinel):
            started.append(s.start())
        yield primary, replica, sentinel
    finally:
        for s in started:
            s.kill()


async def _until(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.2)


async def test_registry_and_proxy_client_follow_a_sentinel_failover(sentinel_pair):
    primary, replica, sentinel = sentinel_pair
    url = cs.sentinel_url([sentinel])
    reg = Registry.from_url(url)
    resp = Resp.from_url(url)
    try:
        await _until(lambda: _replica_synced(resp))
        _, sessions = await reg.create_task(
            TaskRequest(task_id="fo-1", instruction="x", num_samples=3)
        )
        s0 = sessions[0].session_id
        assert (await reg.transition(s0, SessionState.INITIALIZING, node="n")).ok
        assert await resp.call("WAIT", 1, 2000) == 1  # on the replica before the fault
        assert (await resp.call("ROLE"))[0] == b"master"
        old = resp.port
        primary.kill()
        started = time.monotonic()

        async def moved() -> bool:
            try:
                return await resp.call("PING") == b"PONG" and resp.port != old
            except RedisUnavailable:
                return False

        await _until(moved)
        assert resp.port == replica.port
        # the registry's client finds the new primary too, and nothing written is gone
        got = await _retrying(lambda: reg.transition(s0, SessionState.READY, node="n"))
        assert got.ok and got.from_state == SessionState.INITIALIZING
        assert (await reg.get_session(sessions[1].session_id)).state == SessionState.REGISTERED
        print(f"failover seen by the proxy client after {time.monotonic() - started:.2f}s")
    finally:
        await reg.close()
        await resp.aclose()


async def _replica_synced(resp: Resp) -> bool:
    try:
        info = (await resp.call("INFO", "replication")).decode()
    except RedisUnavailable:
        return False
    return "connected_slaves:1" in info and "state=online" in info
