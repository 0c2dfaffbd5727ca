"""Backbone operations and CPU per session (issue 20's capacity inputs).

Runs scheduler, pool, executor, builder and evaluator as real service processes
against their own nats-server (with its monitoring port) and Valkey, submits N
sessions of a shell harness that makes no model calls (``true``; the ``command``
evaluator), waits until every trajectory is on ``polar.trajectories.<task>``, and
reports per session:

- Redis commands, from ``INFO commandstats`` before and after (by command);
- NATS messages in and out of the server, from ``/varz`` before and after;
- CPU milliseconds per service process (utime + stime from /proc), and NATS's and
  Valkey's own.

A model call adds to this what the proxy does per call (2 Redis commands, 1 JetStream
publish + ack: docs/benchmarks/index.md, proxy); ``docs/explanation/scaling.md`` combines the two.

    python tests/bench/bench_ops.py [--sessions 200] [--tasks 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import orjson  # noqa: E402

from infra import localservers  # noqa: E402
from schemas import subjects as S  # noqa: E402
from services.common.bus import Bus  # noqa: E402
from services.common.endpoints import redis_client  # noqa: E402
from tests.helpers.procs import ServiceProcess  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
SERVICES = {
    "scheduler": "services.scheduler.main:create_app",
    "pool": "services.pool.main:create_app",
    "executor": "services.executor.main:create_app",
    "builder": "services.builder.main:create_app",
    "evaluator": "services.evaluator.main:create_app",
}


def cpu_ms(pid: int) -> float:
    """utime + stime (and reaped children's) of every process in ``pid``'s process group
    (a service is served by a worker process under its launcher), in ms."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pid:  # field 5, pgrp (the group leader's pid)
            total += sum(int(fields[i]) for i in (11, 12, 13, 14))
    return total * 1000 / TICK


def varz(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as r:
        return json.loads(r.read())


async def commandstats(r) -> dict[str, int]:
    info = await r.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in info.items()}


def start_servers(root: Path):
    """nats-server with its monitoring port, and Valkey: (nats, valkey, ports)."""
    nport, mport, rport = (localservers.free_port() for _ in range(3))
    (root / "js").mkdir()
    nats = subprocess.Popen(
        [localservers.nats_server_binary(), "-a", "127.0.0.1", "-p", str(nport),
         "-m", str(mport), "-js", "-sd", str(root / "js")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    localservers.wait_listening("127.0.0.1", nport, nats)
    valkey = localservers.start_valkey(rport, root / "valkey")
    return nats, valkey, (nport, mport, rport)


async def run(
    root: Path, nats, valkey, ports, n_sessions: int, n_tasks: int, idle_s: float = 10.0
) -> dict:
    nport, mport, rport = ports
    nats_url, redis_url = f"nats://127.0.0.1:{nport}", f"redis://127.0.0.1:{rport}/0"
    common = {"nats_url": nats_url, "redis_url": redis_url}
    node = {"work_dir": str(root / "work"), "proxy_url": "http://127.0.0.1:9"}
    limits = {"max_init": 16, "ready_buffer": 16, "max_run": 32}
    configs = {
        "scheduler": {},
        "pool": {**node, **limits},
        "executor": {**node, **limits},
        "builder": {},
        "evaluator": node,
    }
    procs = {}
    try:
        for name, target in SERVICES.items():
            procs[name] = ServiceProcess(target, {**common, **configs[name]}, root / "logs")
            procs[name].start(timeout=90)
        bus = await Bus.open(nats_url, "bench-ops", declare=False)
        r = redis_client(redis_url)
        await asyncio.sleep(2.0)  # let start-up traffic settle

        async def snapshot() -> dict:
            return {
                "redis": await commandstats(r),
                "varz": varz(mport),
                "cpu": {k: cpu_ms(p.proc.pid) for k, p in procs.items()},
                "nats_cpu": cpu_ms(nats.pid),
                "valkey_cpu": cpu_ms(valkey.pid),
            }

        # the idle stack's own traffic (pull requests, heartbeats, lease scans) per second,
        # taken out of the run's deltas: what is left is what sessions cost
        idle0, t0 = await snapshot(), time.monotonic()
        await asyncio.sleep(idle_s)
        idle1, idle_wall = await snapshot(), time.monotonic() - t0
        per = n_sessions // n_tasks
        before = await snapshot()
        started = time.monotonic()
        for i in range(n_tasks):
            spec = {
                "task_id": f"ops-{i}",
                "instruction": "x",
                "num_samples": per,
                "runtime": {"backend": "local"},
                "agent": {"command": "true"},
                "evaluator": {"name": "command", "config": {"command": "echo 1"}},
            }
            await bus.publish(S.TASKS_SUBMIT, orjson.dumps(spec), msg_id=f"ops-{i}")
        want = per * n_tasks
        while True:
            info = await bus.js.stream_info(S.STREAM_TRAJECTORIES)
            if info.state.messages >= want:
                break
            if time.monotonic() - started > 600:
                raise TimeoutError(f"{info.state.messages}/{want} trajectories")
            await asyncio.sleep(0.2)
        wall = time.monotonic() - started
        await asyncio.sleep(2.0)  # trailing acks and heartbeats of the last sessions
        after = await snapshot()
        span = time.monotonic() - started
        scale = span / idle_wall

        def delta(a: dict, b: dict, idle_a: dict, idle_b: dict) -> dict:
            return {
                k: b.get(k, 0) - a.get(k, 0) - scale * (idle_b.get(k, 0) - idle_a.get(k, 0))
                for k in b
            }

        cpu = delta(before["cpu"], after["cpu"], idle0["cpu"], idle1["cpu"])
        flat = {k: before[k] for k in ("nats_cpu", "valkey_cpu")}
        rest = delta(
            flat, {k: after[k] for k in flat}, *({k: x[k] for k in flat} for x in (idle0, idle1))
        )
        cpu["nats-server"], cpu["valkey"] = rest["nats_cpu"], rest["valkey_cpu"]
        redis_ops = delta(before["redis"], after["redis"], idle0["redis"], idle1["redis"])
        redis_ops = {k: v for k, v in redis_ops.items() if v > 0 and k != "info"}
        msgs = {
            key: after["varz"][key] - before["varz"][key]
            - scale * (idle1["varz"][key] - idle0["varz"][key])
            for key in ("in_msgs", "out_msgs", "in_bytes")
        }  # fmt: skip
        idle_rates = {
            "redis_ops_per_s": round(
                sum(v for k, v in idle1["redis"].items() if k != "info")
                - sum(v for k, v in idle0["redis"].items() if k != "info"),
                1,
            )
            / idle_wall,
            "nats_msgs_per_s": (idle1["varz"]["in_msgs"] - idle0["varz"]["in_msgs"]) / idle_wall,
            "cpu_ms_per_s": {
                k: round((idle1["cpu"][k] - idle0["cpu"][k]) / idle_wall, 2) for k in procs
            },
        }
        out = {
            "sessions": want,
            "tasks": n_tasks,
            "wall_s": round(wall, 2),
            "sessions_per_s": round(want / wall, 2),
            "redis_per_session": {k: round(v / want, 2) for k, v in sorted(redis_ops.items())},
            "redis_total_per_session": round(sum(redis_ops.values()) / want, 2),
            "nats_in_msgs_per_session": round(msgs["in_msgs"] / want, 2),
            "nats_out_msgs_per_session": round(msgs["out_msgs"] / want, 2),
            "nats_in_bytes_per_session": round(msgs["in_bytes"] / want),
            "cpu_ms_per_session": {k: round(v / want, 2) for k, v in cpu.items()},
            "idle": idle_rates,
            "load_average": os.getloadavg(),
        }
        await bus.close()
        await r.aclose()
        return out
    finally:
        for p in procs.values():
            p.stop()
        localservers.stop_process(nats.pid)
        localservers.stop_process(valkey.pid)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--tasks", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="polar-bench-ops-"))
    got = asyncio.run(run(root, *start_servers(root), args.sessions, args.tasks))
    print(json.dumps(got, indent=2))
    if args.json:
        args.json.write_text(json.dumps(got, indent=2))


if __name__ == "__main__":
    main()
