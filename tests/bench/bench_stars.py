"""Completions/s through the whole stack for the learning demo's task shape.

Starts the demo's stack (own NATS/Valkey, every service), submits training tasks of
``--questions`` questions x ``--samples`` sessions, and measures how fast scored
trajectories arrive: sessions/s and completions (= traces) /s, side by side for each
shape given. The model is the demo's untrained tiny model (answers are up to 4 tokens).

    python tests/bench/bench_stars.py --shape 1x8 --shape 16x8 --shape 32x8 --shape 64x8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import orjson

from infra import devstack
from infra.topology import parse_topology
from schemas import subjects as S
from services.common.bus import Bus
from services.demo import stars
from services.demo.topology import stack_topology
from services.engine.modelinit import init_model_dir

DIMS = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


async def measure(nats_url: str, questions: int, samples: int, tasks: int, tag: str) -> dict:
    bus = await Bus.open(nats_url, "bench-stars", declare=False)
    templates = stars.training_templates(seed=1, tasks=tasks, questions=questions)
    batch = [
        {**t, "task_id": f"{tag}-{i}", "num_samples": samples} for i, t in enumerate(templates)
    ]
    sub = await bus.js.subscribe(S.trajectories(">"), ordered_consumer=True)
    t0 = time.monotonic()
    for t in batch:
        await bus.js.publish(S.TASKS_SUBMIT, orjson.dumps(t))
    want, got, traces, rewards = tasks * samples, 0, 0, []
    first = None
    while got < want:
        msg = await sub.next_msg(timeout=120)
        traj = orjson.loads(await bus.payload(msg))
        if not traj["task_id"].startswith(tag + "-"):
            continue
        first = first or time.monotonic()
        got += 1
        traces += len(traj["traces"])
        rewards.append(traj.get("reward") or 0.0)
    wall = time.monotonic() - t0
    await sub.unsubscribe()
    await bus.close()
    return {
        "shape": f"{questions}x{samples}",
        "sessions": got,
        "completions": traces,
        "wall_s": round(wall, 2),
        "sessions_per_s": round(got / wall, 1),
        "completions_per_s": round(traces / wall, 1),
        "first_s": round(first - t0, 2),
        "mean_reward": round(sum(rewards) / len(rewards), 3),
        "eval_reason": traj.get("eval_reason"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", default=[], help="QUESTIONSxSAMPLES")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--max-run", type=int, default=8)
    args = ap.parse_args()
    shapes = args.shape or ["1x8", "32x8"]
    state = Path(tempfile.mkdtemp(prefix="polar-bench-stars-"))
    model = init_model_dir(state / "model", seed=0, dims=DIMS, tokenizer="bytes")
    topo = parse_topology(stack_topology(state, model, max_run=args.max_run))
    devstack.up(topo)
    topo = devstack.operator_view(topo)  # the stack's NATS signs the operator in
    try:
        print(f"load: {os.getloadavg()}")
        for i, shape in enumerate(shapes):
            q, g = (int(x) for x in shape.split("x"))
            print(asyncio.run(measure(topo.nats_url, q, g, args.tasks, f"b{i}")), flush=True)
        print(cpu_times(state))
    finally:
        devstack.down(state)


def cpu_times(state: Path) -> dict[str, float]:
    """CPU seconds each stack process's group (the service and its workers) has used."""
    from infra.stackstate import read_state

    tick = os.sysconf("SC_CLK_TCK")
    by_group: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            f = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        by_group[int(f[2])] = by_group.get(int(f[2]), 0.0) + (int(f[11]) + int(f[12])) / tick
    return {p.name: round(by_group.get(p.pid, 0.0), 1) for p in read_state(state).procs}


if __name__ == "__main__":
    main()
