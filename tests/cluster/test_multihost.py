"""Polar across five hosts (network namespaces on one veth bridge), with faults mid-run.

Hosts b1-b3 carry the backbone: a 3-node JetStream cluster (every stream R3), a Valkey
primary (b1) and replica (b2), each refusing writes while no replica follows it
(min-replicas-to-write 1), and three sentinels (quorum 2); b3 also runs the
scheduler, the builder and the model engine (the instant engine of the proxy bench).
Gateway hosts g1 and g2 each run a pool, an executor, an evaluator and a proxy replica;
each session's harness calls the model through its gateway's proxy before and after a
sleep. With at least 100 sessions in flight: the NATS server on b2 is killed, Redis
fails over (SENTINEL FAILOVER: the old primary is demoted and answers READONLY), and g2
is cut off the network for two leases, then brought back. Every session must end in
a final state, every session's trajectory must be on the stream exactly once, and every
COMPLETED one must carry exactly its own attempt's two captured calls and be graded 1 by
its gateway's evaluator in the runtime it ran in (a `command` evaluator finding the file
the harness wrote; a gateway gone past ``orphan_after_seconds`` has its queue taken
over, graded in a fresh runtime: counted and printed apart).

Two sizes: ``ci`` (default; `just test`, ~3 minutes) and ``full`` (`just test-cluster`,
``POLAR_CLUSTER_SIZE=full``): more sessions, longer harnesses.
"""

from __future__ import annotations

import asyncio
import collections
import os
import sys
import time
from typing import NamedTuple

import orjson
import pytest

from infra import clusterservers as cs
from schemas import TERMINAL_STATES, Outcome, SessionState, Trajectory, decode
from schemas import subjects as S
from services.common.bus import Bus
from services.common.registry import Registry
from tests.bench.pipeline_bench.run import ONE_CALL as CALL  # curl, as any client calls
from tests.bench.proxy_bench.backend import MODEL
from tests.cluster.hosts import Net, NsService
from tests.helpers.requires import requires_netns

pytestmark = [pytest.mark.timeout(600), requires_netns]


class Size(NamedTuple):
    tasks: int
    samples: int
    sleep: int  # seconds between a harness's two model calls
    deadline: int  # each task's timeout_seconds
    finish_within: float  # seconds from the first fault to every session final


SIZES = {
    # >= 100 in flight at the faults; 40 s harnesses outlast the first two faults' recovery
    "ci": Size(tasks=10, samples=10, sleep=40, deadline=200, finish_within=300.0),
    "full": Size(tasks=15, samples=10, sleep=60, deadline=240, finish_within=420.0),
}
SIZE_NAME = os.environ.get("POLAR_CLUSTER_SIZE", "ci")
if SIZE_NAME not in SIZES:
    raise pytest.UsageError(f"POLAR_CLUSTER_SIZE={SIZE_NAME!r}: use one of {', '.join(SIZES)}")
SIZE = SIZES[SIZE_NAME]
LEASE = 10.0  # under a loaded machine (load 20+ on 2 cores seen) a shorter lease expires
ENGINE_PORT, PROXY_PORT = 30000, 8200
CALLS = 2  # per attempt: one before the faults, one after (through whichever replica is up)


def run_command(sleep: int) -> str:
    return f'{CALL} && sleep {sleep} && {CALL} && echo "done $POLAR_ATTEMPT" > out.txt'


def spec(i: int, size: Size = SIZE) -> dict:
    return {
        "task_id": f"mh-{i}",
        "instruction": "call the model, sleep, call it again",
        "num_samples": size.samples,
        "max_retries": 2,
        "timeout_seconds": size.deadline,
        "runtime": {"backend": "local", "sandbox": "none"},
        # graded in the session's own runtime, which only its gateway's evaluator reaches
        # (node-affine): out.txt is there and nowhere else (no diff is collected)
        "agent": {"command": run_command(size.sleep), "collect_diff": False},
        "evaluator": {
            "name": "command",
            "runtime": "live",
            "config": {"command": "test -f out.txt && echo 1 || echo 0"},
        },
    }


class Cluster:
    def __init__(self, tmp) -> None:
        self.tmp, self.net = tmp, Net()
        self.servers: list[cs.Server] = []
        self.services: list[NsService] = []

    def up(self, gateways: int = 2) -> None:
        net = self.net.open()
        b = [net.add(f"b{i}") for i in (1, 2, 3)]
        g = [net.add(f"g{i + 1}") for i in range(gateways)]
        nodes = [cs.NatsNode(f"n{i + 1}", h.addr, 4222, 6222) for i, h in enumerate(b)]
        self.nats = cs.nats_cluster(nodes, self.tmp / "nats", [h.wrap for h in b])
        self.nats_url = cs.nats_url(nodes)
        primary = cs.valkey("primary", b[0].addr, 6379, self.tmp / "v", wrap=b[0].wrap)
        replica = cs.valkey(
            "replica", b[1].addr, 6379, self.tmp / "v", replica_of=(b[0].addr, 6379),
            wrap=b[1].wrap,
        )  # fmt: skip
        self.sentinels = [
            cs.sentinel(f"sentinel{i}", h.addr, 26379, (b[0].addr, 6379), self.tmp / f"s{i}",
                        quorum=2, wrap=h.wrap)
            for i, h in enumerate(b)
        ]  # fmt: skip
        # A write the old primary takes after its replica was promoted is lost with it (a
        # session's call counter went back, its next call's record was dropped as a
        # duplicate): it refuses writes once no replica follows it. As many replicas as
        # min-replicas-to-write: with two replicas and 1, the old primary kept the other
        # one until Sentinel moved it, and took (and lost) writes meanwhile. The price:
        # the new primary takes no write until the old one follows it (docs/explanation/scaling.md).
        for server in (primary, replica):
            server.argv += ["--min-replicas-to-write", "1", "--min-replicas-max-lag", "10"]
        self.redis = {"primary": primary, "replica": replica}
        engine = cs.Server(
            "engine", b[2].addr, ENGINE_PORT,
            [sys.executable, "-m", "tests.bench.proxy_bench.backend",
             "--host", b[2].addr, "--port", str(ENGINE_PORT)],
            self.tmp / "engine.log", wrap=b[2].wrap,
        )  # fmt: skip
        for server in (*self.nats, primary, replica, *self.sentinels, engine):
            self.servers.append(server.start())
        self.redis_url = cs.sentinel_url(self.sentinels)
        _replica_following(primary)  # else the first writes are refused (min-replicas)
        common = {"nats_url": self.nats_url, "redis_url": self.redis_url, "nats_replicas": 3}
        logs = self.tmp / "logs"
        plan = [(b[2], "scheduler", {"reconcile_interval_seconds": 1.0}, 8100),
                (b[2], "builder", {}, 8130)]  # fmt: skip
        # each gateway's replica: the instant engine templates nothing (chat mode)
        proxy = {"mode": "chat", "backend": {"kind": "sglang", "model": MODEL,
                 "urls": [f"http://{b[2].addr}:{ENGINE_PORT}"]}}  # fmt: skip
        for host in g:
            node = {
                "node": host.name, "work_dir": str(self.tmp / host.name),
                "proxy_url": f"http://{host.addr}:{PROXY_PORT}",
            }  # fmt: skip
            limits = {"max_init": 16, "ready_buffer": 16, "max_run": 80,
                      "lease_seconds": LEASE, "heartbeat_seconds": 1.0}  # fmt: skip
            plan += [(host, "pool", {**node, **limits}, 8110),
                     (host, "executor", {**node, **limits}, 8120),
                     (host, "evaluator", node, 8140),
                     (host, "proxy", proxy, PROXY_PORT)]  # fmt: skip
        # the scheduler first: it declares the R3 streams the others then find
        first = NsService(*plan[0][:2], {**common, **plan[0][2]}, logs, plan[0][3]).start()
        first.wait_healthy()
        self.services.append(first)
        for host, service, cfg, port in plan[1:]:
            self.services.append(NsService(host, service, {**common, **cfg}, logs, port).start())
        for svc in self.services:
            svc.wait_healthy()

    def down(self) -> None:
        for svc in self.services:
            svc.stop()
        for server in self.servers:
            server.kill()
        self.net.close()


def _replica_following(primary: cs.Server, timeout: float = 30.0) -> None:
    import redis

    r = redis.Redis(host=primary.host, port=primary.port)
    deadline = time.monotonic() + timeout
    try:
        while True:  # a write is taken once the replica is in sync and has acknowledged
            try:
                r.set("mh:writable", b"1")
                return
            except redis.ResponseError as exc:
                assert "NOREPLICAS" in str(exc), exc
                assert time.monotonic() < deadline, "the Valkey replica did not follow in time"
                time.sleep(0.2)
    finally:
        r.close()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:  # down() also after a failed up(): nothing of the test's is left behind
        c.up()
        yield c
    finally:
        c.down()


async def _retry(make, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await make()
        except Exception:  # noqa: BLE001 - a backbone fault in progress
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


async def _counts(reg: Registry, ids: list[str]) -> collections.Counter:
    sessions = await _retry(lambda: reg.get_sessions(ids))
    return collections.Counter(s.state.value for s in sessions if s is not None)


async def _stuck(reg: Registry, ids: list[str]) -> list[tuple]:
    """(session, state, node, attempt) of every session not final yet."""
    return [
        (s.session_id, s.state.value, s.node, s.attempt)
        for s in await reg.get_sessions(ids)
        if s is not None and s.state not in TERMINAL_STATES
    ]


async def _final(reg: Registry, ids: list[str]) -> int:
    c = await _counts(reg, ids)
    return sum(n for state, n in c.items() if state in TERMINAL_STATES)


async def _until(check, what: str, timeout: float = 60.0) -> float:
    """Seconds until ``await check()`` is true."""
    started = time.monotonic()
    while True:
        try:
            if await check():
                return time.monotonic() - started
        except Exception:  # noqa: BLE001 - still recovering
            pass
        assert time.monotonic() - started < timeout, f"{what}: not within {timeout}s"
        await asyncio.sleep(0.1)


STREAMS = (S.STREAM_TASKS, S.STREAM_SESSIONS, S.STREAM_EVENTS, S.STREAM_COMPLETIONS,
           S.STREAM_TRAJECTORIES)  # fmt: skip


async def submit(bus: Bus, reg: Registry, size: Size, prefix: str = "mh") -> list[str]:
    """Submit ``size``'s tasks; their session ids once all are registered."""
    for i in range(size.tasks):
        task = {**spec(i, size), "task_id": f"{prefix}-{i}"}
        await bus.publish(S.TASKS_SUBMIT, orjson.dumps(task), msg_id=f"{prefix}-{i}")
    ids: list[str] = []
    while len(ids) < size.tasks * size.samples:
        ids = [
            sid for i in range(size.tasks) for sid in await reg.task_session_ids(f"{prefix}-{i}")
        ]
        await asyncio.sleep(0.3)
    return ids


async def test_multihost_faults(cluster: Cluster):
    bus = await Bus.open(cluster.nats_url, "mh-driver", declare=False)
    reg = Registry.from_url(cluster.redis_url)
    try:
        ids = await submit(bus, reg, SIZE)
        started = time.monotonic()
        # in flight: every session not final yet, >= 60 of them running harnesses (INIT
        # on two loaded cores does not get all of them running at once)
        while True:
            c = await _counts(reg, ids)
            live = sum(n for state, n in c.items() if state not in TERMINAL_STATES)
            if live >= 100 and c["RUNNING"] >= 60:
                break
            assert time.monotonic() - started < 150, c
            await asyncio.sleep(0.3)
        faults: list[tuple[str, int, float]] = []  # (fault, in flight then, recovery s)

        async def inject(name: str, act, recovered) -> None:
            c = await _counts(reg, ids)
            running = sum(n for state, n in c.items() if state not in TERMINAL_STATES)
            await act()
            faults.append((name, running, await _until(recovered, name)))

        async def kill_nats() -> None:
            cluster.nats[1].kill()

        async def leaders_moved() -> bool:  # every stream led by a live server, writable
            infos = [await bus.js.stream_info(name) for name in STREAMS]
            return all(i.cluster and i.cluster.leader not in (None, "n2") for i in infos)

        import redis.asyncio as aioredis

        async def failover() -> None:
            s = cluster.sentinels[2]
            r = aioredis.Redis(host=s.host, port=s.port)
            await r.execute_command("SENTINEL", "FAILOVER", "polar")
            await r.aclose()

        old_primary = cluster.redis["primary"].host

        async def writable_elsewhere() -> bool:
            await reg.redis.set("mh:probe", b"1")
            pool = reg.redis.connection_pool
            host, _ = await pool.get_master_address()
            return host != old_primary

        first_fault = time.monotonic()
        await inject("kill NATS server n2 (b2)", kill_nats, leaders_moved)
        await inject("Redis failover (SENTINEL FAILOVER)", failover, writable_elsewhere)
        cut_at = time.monotonic()
        at_cut = {
            s.session_id: s.attempt
            for s in await reg.get_sessions(ids)
            if s and s.node == "g2" and s.state not in TERMINAL_STATES
        }
        on_g2 = list(at_cut)
        cluster.net.cut("g2")
        await asyncio.sleep(2 * LEASE)
        cluster.net.restore("g2")

        async def taken_over() -> bool:  # each final, or its next attempt under way
            now = await reg.get_sessions(on_g2)
            return all(
                s.state in TERMINAL_STATES
                or (s.attempt > at_cut[s.session_id] and s.state != SessionState.REGISTERED)
                for s in now
            )

        while not await _retry(taken_over):
            assert time.monotonic() - cut_at < 240, await _stuck(reg, on_g2)
            await asyncio.sleep(0.5)
        faults.append((f"cut g2 off for {2 * LEASE:.0f}s", len(on_g2), time.monotonic() - cut_at))

        while await _final(reg, ids) < len(ids):
            assert time.monotonic() - first_fault < SIZE.finish_within, await _stuck(reg, ids)
            await asyncio.sleep(0.5)
        delivered = await _trajectories(bus, len(ids))
        counts = await _counts(reg, ids)
        sessions = {s.session_id: s for s in await reg.get_sessions(ids) if s}
        retried = sum(1 for s in sessions.values() if s.attempt > 0)
        print(f"\nsize {SIZE_NAME}: {SIZE}")
        print("fault                                   | in flight | recovery s")
        for name, running, seconds in faults:
            print(f"{name:<40}| {running:>9} | {seconds:>9.1f}")
        per = collections.Counter(t.session_id for t in delivered)
        lost = [sid for sid in ids if sid not in per]
        dup = [sid for sid, n in per.items() if n > 1]
        completed = [t for t in delivered if t.outcome == Outcome.COMPLETED]
        # exactly its own attempt's calls: not one of a stale attempt's, none missing
        calls = collections.Counter(t.stats.completions for t in completed)
        wrong = [
            (t.session_id, t.attempt, sessions[t.session_id].attempt, t.stats.completions)
            for t in completed
            if t.stats.completions != CALLS
            or not t.intact
            or t.attempt != sessions[t.session_id].attempt
        ]
        print(f"sessions {len(ids)}  final {sum(counts.values())}  {dict(counts)}")
        print(f"retried {retried}  trajectories {len(delivered)}  lost {len(lost)}  "
              f"duplicated {len(dup)}")  # fmt: skip
        print(f"COMPLETED trajectories by captured calls {dict(calls)}  wrong {wrong[:5]}")
        # in its live runtime unless the gateway's queue was taken over (noted "fresh: ...")
        taken_over = [t for t in completed if "runtime" in t.metadata.get("eval_details", {})]
        misgraded = [
            (t.session_id, t.reward, t.eval_reason)
            for t in completed
            if t not in taken_over and t.reward != 1.0
        ]
        print(f"COMPLETED graded in their live runtime {len(completed) - len(taken_over)}  "
              f"taken over {len(taken_over)}  misgraded {misgraded[:5]}")  # fmt: skip
        why = collections.Counter(
            (s.state.value, s.attempt, (s.reason or "")[:60])
            for s in sessions.values()
            if s.state != SessionState.COMPLETED or s.attempt > 0
        )
        print("not COMPLETED, or retried (state, attempt, last reason):")
        for key, n in why.most_common(8):
            print(f"  {n:>4}  {key}")
        assert sum(counts.values()) == len(ids) and set(counts) <= TERMINAL_STATES
        assert not lost and not dup
        assert completed and not wrong
        assert not misgraded
    finally:
        await reg.close()
        await bus.close()


async def _trajectories(bus: Bus, want: int, timeout: float = 60.0) -> list[Trajectory]:
    """Every trajectory on the stream (once it holds ``want``, or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        info = await _retry(lambda: bus.js.stream_info(S.STREAM_TRAJECTORIES))
        if info.state.messages >= want or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await _retry(lambda seq=seq: bus.js.get_msg(S.STREAM_TRAJECTORIES, seq))
        out.append(decode(await bus.payload(msg), Trajectory))
    return out
