"""Capacity simulation for many gateway hosts, driven by measured per-session costs.

Inputs: ``tests/bench/bench_ops.py --json`` (Redis commands, NATS messages and CPU per
session through scheduler, pool, executor, builder, evaluator, measured here) and the
proxy's measured per-call cost (docs/benchmarks/history.md: token mode 2,595 requests per
CPU-second at best, 2 Redis commands and 1 JetStream publish + ack per call). For C
concurrent sessions of D seconds each making K model calls, Little's law gives the
session rate C / D; steady-state lease renewal (one HSET per held session and one ZADD
per holder every lease/3 s) and heartbeats come on top. Each row says how loaded the
parts that do not scale out are (the one Redis primary: the registry's scripts span a
task's and global keys; each JetStream stream's leader: one server orders a stream)
and how many replicas of the parts that do are needed.

    python tests/bench/sim_scaling.py --ops ops.json [--sessions 100000]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

# Measured on this machine (docs/benchmarks/history.md, proxy): best token-mode requests per
# CPU-second of the proxy, and what each call does on the backbone.
PROXY_CALLS_PER_CPU_S = 2595.0
REDIS_OPS_PER_CALL = 2
NATS_MSGS_PER_CALL = 2  # the completion record's publish and its ack
HEADROOM = 0.7  # plan each single-threaded part to 70 % of one core


@dataclass(frozen=True)
class Measured:
    redis_ops: float  # per session, whole pipeline, no model calls
    nats_msgs: float  # in + out of the server, per session
    service_cpu_ms: dict[str, float]  # per session
    valkey_cpu_ms: float
    nats_cpu_ms: float

    @classmethod
    def load(cls, path: Path) -> Measured:
        d = json.loads(path.read_text())
        cpu = dict(d["cpu_ms_per_session"])
        return cls(
            redis_ops=d["redis_total_per_session"],
            nats_msgs=d["nats_in_msgs_per_session"] + d["nats_out_msgs_per_session"],
            service_cpu_ms={k: v for k, v in cpu.items() if k not in ("valkey", "nats-server")},
            valkey_cpu_ms=cpu["valkey"],
            nats_cpu_ms=cpu["nats-server"],
        )

    @property
    def valkey_us_per_op(self) -> float:
        return 1000 * self.valkey_cpu_ms / self.redis_ops

    @property
    def nats_us_per_msg(self) -> float:
        return 1000 * self.nats_cpu_ms / self.nats_msgs


@dataclass(frozen=True)
class Load:
    sessions: int  # concurrent
    hosts: int  # gateway hosts
    seconds: float  # a session's length
    calls: int  # model calls per session
    lease_s: float = 30.0
    heartbeat_s: float = 5.0
    replicas: int = 3  # JetStream stream replicas
    streams: int = 5  # tasks, sessions, events, completions, trajectories


def simulate(m: Measured, w: Load) -> dict:
    rate = w.sessions / w.seconds  # sessions started (and finished) per second
    calls = rate * w.calls
    renew = w.sessions / (w.lease_s / 3) + 2 * w.hosts / (w.lease_s / 3)  # HSETs + ZADDs
    beats = 3 * w.hosts / w.heartbeat_s + 2 * w.hosts / (w.lease_s / 2)  # + reaper scans
    redis = rate * m.redis_ops + calls * REDIS_OPS_PER_CALL + renew + beats
    redis_core = redis * m.valkey_us_per_op / 1e6
    msgs = rate * m.nats_msgs + calls * NATS_MSGS_PER_CALL + beats
    # every message is stored on `replicas` servers; the busiest stream's leader orders
    # the completions (one record per call) or the events (several per session)
    leader_msgs = max(calls * NATS_MSGS_PER_CALL, rate * m.nats_msgs / 2)
    leader_core = leader_msgs * m.nats_us_per_msg / 1e6
    cluster_cores = msgs * w.replicas * m.nats_us_per_msg / 1e6
    proxy_cores = calls / PROXY_CALLS_PER_CPU_S
    svc = {k: rate * v / 1000 for k, v in m.service_cpu_ms.items()}
    need = {k: max(1, math.ceil(c / HEADROOM)) for k, c in svc.items()}
    loads = {
        "Redis primary": redis_core,
        "busiest stream leader": leader_core,
    }
    bottleneck = max(loads, key=loads.get)
    return {
        "hosts": w.hosts,
        "sessions/host": w.sessions // w.hosts,
        "session s": w.seconds,
        "calls/session": w.calls,
        "sessions/s": rate,
        "calls/s": calls,
        "redis ops/s": redis,
        "redis core %": 100 * redis_core,
        "jetstream msgs/s": msgs,
        "leader core %": 100 * leader_core,
        "nats cores (cluster)": cluster_cores,
        "proxy cores/host": proxy_cores / w.hosts,
        "replicas": need,
        "bottleneck": bottleneck if loads[bottleneck] > HEADROOM else "none (<70 %)",
    }


def table(rows: list[dict]) -> str:
    head = (
        "| hosts | sessions/host | session s | calls | sessions/s | calls/s | Redis ops/s "
        "(primary core) | JetStream msgs/s (busiest leader core) | NATS cores, R3 | "
        "proxy cores/host | scheduler / pool / executor / builder / evaluator cores | "
        "over 70 % of one core |"
    )
    out = [head, "|" + "---|" * 12]
    for r in rows:
        rep = r["replicas"]
        reps = " / ".join(str(rep.get(k, "-")) for k in (
            "scheduler", "pool", "executor", "builder", "evaluator"))  # fmt: skip
        out.append(
            f"| {r['hosts']:,} | {r['sessions/host']:,} | {r['session s']:.0f} | "
            f"{r['calls/session']} | {r['sessions/s']:,.0f} | {r['calls/s']:,.0f} | "
            f"{r['redis ops/s']:,.0f} ({r['redis core %']:.0f} %) | "
            f"{r['jetstream msgs/s']:,.0f} ({r['leader core %']:.0f} %) | "
            f"{r['nats cores (cluster)']:.1f} | {r['proxy cores/host']:.2f} | {reps} | "
            f"{r['bottleneck']} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=Path, required=True, help="bench_ops.py --json output")
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--valkey-us", type=float, help="CPU µs per Redis op (else: measured)")
    ap.add_argument("--nats-us", type=float, help="CPU µs per NATS msg (else: measured)")
    args = ap.parse_args()
    m = Measured.load(args.ops)
    if args.valkey_us:
        m = dataclasses.replace(m, valkey_cpu_ms=args.valkey_us * m.redis_ops / 1000)
    if args.nats_us:
        m = dataclasses.replace(m, nats_cpu_ms=args.nats_us * m.nats_msgs / 1000)
    print(
        f"measured: {m.redis_ops:.1f} Redis ops and {m.nats_msgs:.1f} NATS msgs per session; "
        f"Valkey {m.valkey_us_per_op:.1f} µs CPU/op, nats-server {m.nats_us_per_msg:.1f} µs "
        f"CPU/msg; services ms CPU/session {m.service_cpu_ms}"
    )
    rows = [
        simulate(m, Load(sessions=args.sessions, hosts=h, seconds=s, calls=k))
        for h in (100, 300, 1000)
        for s, k in ((600, 50), (120, 20), (30, 5))
    ]
    print(table(rows))


if __name__ == "__main__":
    main()
