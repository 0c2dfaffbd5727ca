"""Throughput with 1, 2 and 3 gateway hosts, on the multi-host test's harness.

    sudo python -m tests.bench.bench_cluster [--tasks 20] [--gateways 1,2,3] [--out F.json]

Per gateway count: tests/cluster's five-host layout (b1-b3: 3-node JetStream cluster R3,
Valkey primary + replica + sentinels, scheduler, builder and the instant engine on b3)
with that many gateway hosts (pool, executor, evaluator and proxy replica each), as
network namespaces on one bridge; no faults. ``tasks`` x 10 sessions, each making two
model calls through its gateway's proxy (``curl``; no sleep), are submitted at once.
Reported: sessions/s from submit to the last final state, the steady rate between the
10th and 90th percent of finals, the CPU time of every process in the namespaces per
session (harnesses included) and the machine's load average. Every host shares this
machine's cores, so the numbers say how the pipeline spreads, not what more machines add.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from services.common.bus import Bus
from services.common.registry import Registry
from tests.cluster.hosts import ip
from tests.cluster.test_multihost import Cluster, Size, _counts, submit
from tests.helpers.requires import netns_missing

SAMPLES = 10


def cpu_seconds(cluster: Cluster) -> float:
    """CPU time of every process in the cluster's namespaces so far, with the children
    they reaped (the harnesses)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for host in cluster.net.hosts.values():
        for pid in ip("netns", "pids", host.ns, check=False).stdout.split():
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / tick


async def measure(cluster: Cluster, size: Size, prefix: str) -> dict:
    bus = await Bus.open(cluster.nats_url, "bench-cluster", declare=False)
    reg = Registry.from_url(cluster.redis_url)
    try:
        cpu0 = cpu_seconds(cluster)
        t0 = time.monotonic()
        ids = await submit(bus, reg, size, prefix=prefix)
        finals: list[float] = []  # seconds after submit at which the count of finals rose
        done = 0
        while done < len(ids):
            c = await _counts(reg, ids)
            now = sum(n for state, n in c.items() if state in ("COMPLETED", "TIMEOUT", "ERROR"))
            finals += [time.monotonic() - t0] * (now - done)
            done = now
            if time.monotonic() - t0 > 900:
                raise RuntimeError(f"not all final after 900 s: {dict(c)}")
            await asyncio.sleep(0.25)
        lo, hi = finals[len(finals) // 10], finals[(len(finals) * 9) // 10 - 1]
        steady = (len(finals) * 8 // 10) / (hi - lo) if hi > lo else float("nan")
        cpu = cpu_seconds(cluster) - cpu0
        return {
            "sessions": len(ids),
            "cpu_ms_per_session": round(1000 * cpu / len(ids), 1),
            "wall_s": round(finals[-1], 1),
            "sessions_per_s": round(len(ids) / finals[-1], 2),
            "steady_per_s": round(steady, 2),
            "states": dict(c),
            "load1": round(os.getloadavg()[0], 1),
        }
    finally:
        await reg.close()
        await bus.close()


def run(gateways: int, tasks: int) -> dict:
    size = Size(tasks=tasks, samples=SAMPLES, sleep=0, deadline=900, finish_within=900.0)
    warm = Size(tasks=2, samples=SAMPLES, sleep=0, deadline=900, finish_within=900.0)
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            cluster.up(gateways=gateways)
            asyncio.run(measure(cluster, warm, "warm"))  # first-call costs out
            return {"gateways": gateways, **asyncio.run(measure(cluster, size, "bench"))}
        finally:
            cluster.down()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=20, help="tasks of 10 sessions per run")
    ap.add_argument("--gateways", default="1,2,3")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if reason := netns_missing():
        sys.exit(f"cannot run: {reason}")
    rows = []
    for n in (int(g) for g in args.gateways.split(",")):
        rows.append(run(n, args.tasks))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| gateway hosts | sessions | wall s | sessions/s | steady sessions/s "
          "| CPU ms / session | load1 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['gateways']} | {r['sessions']} | {r['wall_s']} | {r['sessions_per_s']} "
            f"| {r['steady_per_s']} | {r['cpu_ms_per_session']} | {r['load1']} |"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
