"""One measured run on a running stack: submit, follow every session to its committed
trajectory, and read what it cost."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas import SessionStateChanged, decode
from schemas import subjects as S
from services.client import TrajectoryClient
from services.common.bus import Bus
from services.common.endpoints import redis_client
from tests.bench.pipeline_bench import measure
from tests.bench.pipeline_bench.stack import TreeStack
from tests.bench.proxy_bench.backend import MODEL

ONE_CALL = (  # one chat call through the session's proxy route, as any OpenAI client makes
    'curl -sSf -o /dev/null -H "authorization: Bearer $OPENAI_API_KEY" '
    "-H 'content-type: application/json' "
    f"""-d '{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":2}}' """
    '"$OPENAI_BASE_URL/chat/completions"'
)
AGENTS = {"noop": "true", "one-call": ONE_CALL}
STALL_SECONDS = 180.0  # no trajectory for this long: the run failed


@dataclass
class Plan:
    variant: str
    sessions: int
    group: int  # sessions per task (a GRPO group)
    warmup: int
    idle_seconds: float


def task_spec(task_id: str, n: int, variant: str) -> bytes:
    return orjson.dumps(
        {
            "task_id": task_id,
            "instruction": "x",
            "num_samples": n,
            # the pipeline's own cost, as the baseline measured it: the shell
            # harness's default since then is bubblewrap, a sandbox per command
            "runtime": {"backend": "local", "sandbox": "none"},
            "agent": {"command": AGENTS[variant]},
        }
    )


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


class Follower:
    """Commits every trajectory of the run through a TrajectoryClient, as a trainer would,
    and notes when each was committed."""

    def __init__(self, client: TrajectoryClient) -> None:
        self.client = client
        self.committed: dict[str, float] = {}  # session -> commit time (epoch s)
        self.trajectories: dict[str, object] = {}

    async def until(self, task_prefix: str, want: int) -> None:
        got = 0
        deliveries = aiter(self.client.trajectories())
        while got < want:
            try:
                item = await asyncio.wait_for(anext(deliveries), STALL_SECONDS)
            except TimeoutError:
                raise TimeoutError(
                    f"{got}/{want} trajectories, none for {STALL_SECONDS}s"
                ) from None
            await item.commit()
            t = item.trajectory
            if t.task_id.startswith(task_prefix):
                self.committed[t.session_id] = time.time()
                self.trajectories[t.session_id] = t
                got += 1


async def submit(bus: Bus, prefix: str, n: int, group: int, variant: str) -> dict[str, float]:
    """Tasks of ``group`` sessions (the last one smaller); task id -> when published."""
    sent: dict[str, float] = {}
    for i, start in enumerate(range(0, n, group)):
        task_id = f"{prefix}{i:05d}"
        sent[task_id] = time.time()
        await bus.publish(
            S.TASKS_SUBMIT, task_spec(task_id, min(group, n - start), variant), msg_id=task_id
        )
    return sent


async def first_entered(bus: Bus, state: str, prefix: str) -> dict[str, float]:
    """session -> when it first entered ``state`` (from the events stream)."""
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL)
    sub = await bus.js.pull_subscribe(S.session_event(state), stream=S.STREAM_EVENTS, config=config)
    out: dict[str, float] = {}
    try:
        while True:
            try:
                msgs = await sub.fetch(1000, timeout=2)
            except TimeoutError:  # nats-py's, or asyncio's when its deadline runs out first
                return out
            for msg in msgs:
                ev = decode(msg.data, SessionStateChanged)
                if ev.task_id.startswith(prefix):
                    out.setdefault(ev.session_id, ev.ts)
    finally:
        await sub.unsubscribe()


class Profiler:
    """py-spy on one service's process group for the length of a run (raw stacks)."""

    def __init__(self, pid: int, out: Path) -> None:
        spy = shutil.which("py-spy") or Path(sys.executable).with_name("py-spy")
        argv = [
            str(spy),
            "record",
            "--pid",
            str(pid),
            "--subprocesses",
            "--rate",
            "250",
            "--gil",
            "--format",
            "raw",
            "--output",
            str(out),
        ]
        self.out = out
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> Path:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=60)
        if not self.out.exists():
            raise RuntimeError(f"py-spy wrote nothing: {err.decode()[-2000:]}")
        return self.out


def per_session(before, after, idle0, idle1, idle_wall, span, n) -> dict:
    """CPU ms per session per process (own, children), the idle stack's rate taken out."""
    scale = span / idle_wall
    out = {}
    for name in after.cpu:
        row = []
        for k in (0, 1):
            used = after.cpu[name][k] - before.cpu[name][k]
            idle = idle1.cpu[name][k] - idle0.cpu[name][k]
            row.append(max(0.0, used - scale * idle) * 1000 / n)
        out[name] = tuple(row)
    return out


async def measured(stack: TreeStack, plan: Plan, profile: tuple[str, ...] = ()) -> dict:
    """``profile``: services to run py-spy on during the measured part."""
    bus = await Bus.open(stack.nats_url, "bench-pipeline", declare=False)
    redis = redis_client(stack.redis_url)
    client = TrajectoryClient(
        stack.nats_url,
        durable=f"bench-{plan.variant}-{os.getpid()}",
        start="new",
        group_timeout=None,
    )
    await client.connect()
    follow = Follower(client)
    try:
        tag = f"{plan.variant.replace('-', '')}{int(time.time() * 1000) % 10**8}"
        await submit(bus, f"{tag}w", plan.warmup, plan.warmup, plan.variant)
        await follow.until(f"{tag}w", plan.warmup)
        await asyncio.sleep(1.0)  # the warm-up's trailing acks and events

        idle0, t0 = await measure.snapshot(stack.pids, redis, bus), time.monotonic()
        await asyncio.sleep(plan.idle_seconds)
        idle1 = await measure.snapshot(stack.pids, redis, bus)
        idle_wall = time.monotonic() - t0

        spies = {
            name: Profiler(stack.pids[name], stack.state_dir / f"{name}.pyspy") for name in profile
        }
        before, started = await measure.snapshot(stack.pids, redis, bus), time.monotonic()
        sent = await submit(bus, f"{tag}r", plan.sessions, plan.group, plan.variant)
        await follow.until(f"{tag}r", plan.sessions)
        wall = time.monotonic() - started
        await asyncio.sleep(1.0)  # the last sessions' trailing acks and events
        after = await measure.snapshot(stack.pids, redis, bus)
        span = time.monotonic() - started
        profiles = {name: str(spy.stop()) for name, spy in spies.items()}

        n = plan.sessions
        run_ids = {s: t for s, t in follow.committed.items() if s.startswith(f"{tag}r")}
        inits = await first_entered(bus, "INITIALIZING", f"{tag}r")
        e2e = [t - sent[s.rsplit("-", 1)[0]] for s, t in run_ids.items()]
        pipe = [t - inits[s] for s, t in run_ids.items() if s in inits]
        trajs = [follow.trajectories[s] for s in run_ids]
        return {
            "tree": stack.label,
            "variant": plan.variant,
            "sessions": n,
            "wall_s": wall,
            "sessions_per_s": n / wall,
            "latency_ms": {
                "submit_p50": pct(e2e, 50) * 1e3,
                "submit_p99": pct(e2e, 99) * 1e3,
                "init_p50": pct(pipe, 50) * 1e3,
                "init_p99": pct(pipe, 99) * 1e3,
            },
            "cpu_ms": per_session(before, after, idle0, idle1, idle_wall, span, n),
            "client_cpu_ms": (after.client_cpu - before.client_cpu) * 1000 / n,
            "idle_cpu_ms_per_s": {
                k: (idle1.cpu[k][0] - idle0.cpu[k][0]) * 1000 / idle_wall for k in idle1.cpu
            },
            "rss_mb": {k: (before.rss[k] / 2**20, after.rss[k] / 2**20) for k in after.rss},
            "redis_bytes": (after.redis_memory - before.redis_memory) / n,
            "redis_commands": (
                after.redis_commands
                - before.redis_commands
                - (idle1.redis_commands - idle0.redis_commands) * span / idle_wall
            )
            / n,
            "streams": {
                k: (
                    (m - before.streams.get(k, (0, 0))[0]) / n,
                    (b - before.streams.get(k, (0, 0))[1]) / n,
                )
                for k, (m, b) in after.streams.items()
            },
            "outcomes": _count(str(t.outcome.value) for t in trajs),
            "traces": _count(str(len(t.traces)) for t in trajs),
            "load_average": os.getloadavg(),
            "profiles": profiles,
        }
    finally:
        await client.close()
        await bus.close()
        await redis.aclose()


def _count(xs) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return out


async def retention(stack: TreeStack) -> dict:
    """What is left after the runs, and what the streams' limits are."""
    bus = await Bus.open(stack.nats_url, "bench-pipeline-census", declare=False)
    redis = redis_client(stack.redis_url)
    try:
        return {
            "keys": await measure.key_census(redis),
            "streams": await measure.stream_limits(bus),
        }
    finally:
        await bus.close()
        await redis.aclose()
