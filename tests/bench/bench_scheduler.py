"""Scheduler and registry benchmarks (issue 2).

- submit -> sessions registered + init work published, for 1,000-session tasks
  (sessions/s; p50/p99 of per-task latency) and for many small tasks (p50/p99);
- registry CAS transitions/s at several concurrencies.

Runs against its own nats-server and Valkey on free ports:
    python tests/bench/bench_scheduler.py [--big-tasks 5] [--small-tasks 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infra import localservers  # noqa: E402
from schemas import SessionState, TaskAccepted, decode  # noqa: E402
from schemas import subjects as S  # noqa: E402
from services.common.bus import Bus  # noqa: E402
from services.common.registry import Registry  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.scheduler.handlers import Scheduler  # noqa: E402
from services.scheduler.main import consumers  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def submit_latency(bus: Bus, tasks: list[bytes]) -> list[float]:
    """Publish each task and time it until its TaskAccepted event (all sessions registered,
    all init work published)."""
    sub = await bus.nc.subscribe(S.TASKS_ACCEPTED)
    out = []
    for raw in tasks:
        t0 = time.perf_counter()
        await bus.js.publish(S.TASKS_SUBMIT, raw)
        decode(await bus.payload(await sub.next_msg(timeout=120)), TaskAccepted)
        out.append(time.perf_counter() - t0)
    await sub.unsubscribe()
    return out


async def transitions_per_second(reg: Registry, n_sessions: int, concurrency: int) -> float:
    task_id = f"bench-cas-{concurrency}"
    from schemas import TaskRequest

    await reg.create_task(TaskRequest(task_id=task_id, instruction="x", num_samples=n_sessions))
    ids = await reg.task_session_ids(task_id)
    path = [SessionState.INITIALIZING, SessionState.READY, SessionState.RUNNING]
    queue = [(sid, st) for st in path for sid in ids]
    sem = asyncio.Semaphore(concurrency)

    async def one(sid, st):
        async with sem:
            assert (await reg.transition(sid, st)).ok

    t0 = time.perf_counter()
    for st in path:  # keep per-session order: one wave per state
        await asyncio.gather(*(one(sid, s) for sid, s in queue if s == st))
    return len(queue) / (time.perf_counter() - t0)


async def main(args) -> None:
    state = Path(tempfile.mkdtemp(prefix="polar-bench-"))
    nport, rport = localservers.free_port(), localservers.free_port()
    nats = localservers.start_nats(nport, state / "nats")
    valkey = localservers.start_valkey(rport, state / "valkey")
    try:
        bus = await Bus.open(f"nats://127.0.0.1:{nport}", "bench")
        reg = Registry.from_url(
            f"redis://127.0.0.1:{rport}/0", publish=lambda s, p, m: bus.publish(s, p, msg_id=m)
        )
        sched = Scheduler(bus, reg, SchedulerConfig())
        runners = [asyncio.create_task(c.run()) for c in consumers(sched)]

        big = [
            orjson.dumps({"task_id": f"big-{i}", "instruction": "x", "num_samples": 1000})
            for i in range(args.big_tasks)
        ]
        lat_big = await submit_latency(bus, big)
        small = [
            orjson.dumps({"task_id": f"small-{i}", "instruction": "x", "num_samples": 8})
            for i in range(args.small_tasks)
        ]
        lat_small = await submit_latency(bus, small)

        print("\n## Scheduler: submit -> sessions registered + init work published")
        print("| workload | tasks | sessions/s | p50 ms | p99 ms |")
        print("|---|---|---|---|---|")
        for name, lat, n in (
            ("1,000-session task", lat_big, 1000),
            ("8-session task", lat_small, 8),
        ):
            rate = n * len(lat) / sum(lat)
            print(
                f"| {name} | {len(lat)} | {rate:,.0f} | {statistics.median(lat) * 1e3:.1f} "
                f"| {pct(lat, 0.99) * 1e3:.1f} |"
            )

        print("\n## Registry: compare-and-set transitions (Lua) + event publish")
        print("| concurrency | transitions/s |")
        print("|---|---|")
        for conc in (1, 16, 64):
            print(f"| {conc} | {await transitions_per_second(reg, 1000, conc):,.0f} |")
        reg_nopub = Registry(reg.redis)
        reg_nopub_rate = await transitions_per_second_nopub(reg_nopub)
        print(f"| 64 (no event publish) | {reg_nopub_rate:,.0f} |")

        for c in consumers(sched):
            c.stop()
        for r in runners:
            r.cancel()
        await bus.close()
    finally:
        localservers.stop_process(nats.pid)
        localservers.stop_process(valkey.pid)


async def transitions_per_second_nopub(reg: Registry) -> float:
    from schemas import TaskRequest

    await reg.create_task(TaskRequest(task_id="bench-nopub", instruction="x", num_samples=1000))
    ids = await reg.task_session_ids("bench-nopub")
    sem = asyncio.Semaphore(64)

    async def one(sid, st):
        async with sem:
            await reg.transition(sid, st)

    t0 = time.perf_counter()
    for st in (SessionState.INITIALIZING, SessionState.READY, SessionState.RUNNING):
        await asyncio.gather(*(one(sid, st) for sid in ids))
    return 3000 / (time.perf_counter() - t0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--big-tasks", type=int, default=5)
    ap.add_argument("--small-tasks", type=int, default=200)
    asyncio.run(main(ap.parse_args()))
