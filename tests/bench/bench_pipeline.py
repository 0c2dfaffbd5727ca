"""The whole pipeline (issue 18): submit -> scheduler -> pool -> executor -> harness ->
builder -> evaluator -> ``TrajectoryClient`` commit, on real NATS, Valkey and services.

Each checkout measured runs its own ``polar up`` (tests/bench/pipeline_bench/stack.py:
own nats-server and Valkey, one node, the proxy in chat mode in front of the instant
engine of tests/bench/proxy_bench). Variants: ``noop`` (shell harness running ``true``, `sandbox: none`)
and ``one-call`` (the harness makes one chat call through its session's proxy route with
curl). Per run, after a warm-up task: sessions/s, p50/p99 session latency (submit ->
commit, and INITIALIZING -> commit: the queue for a slot left out; all sessions are
submitted at once, as tasks of ``--group`` sessions), CPU ms per session of every
service, nats-server, Valkey and the instant engine (own, and reaped children's: the
harness processes), with the idle stack's rate taken out; Valkey memory and commands
per session, and every stream's messages and bytes per session. At the end: the Redis
keys left (count, share without a TTL, mean size) and every stream's retention limits.

``--baseline REF`` also measures REF (a ``git worktree`` in a temp dir, removed after):
both stacks are up at once and each variant runs on one, then the other, so before and
after share the machine's load. ``--profile SERVICE ...`` adds a noop run with py-spy
(``pip install py-spy``) on those services of the last tree, and tables of where their
Python CPU goes.

    python tests/bench/bench_pipeline.py [--sessions 100] [--variants noop one-call]
        [--baseline REF] [--group 10] [--bounds 4,4,8] [--profile pool] [--json out.json]
    python tests/bench/bench_pipeline.py --sessions 10000 --variants noop   # scale run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.pipeline_bench import report  # noqa: E402
from tests.bench.pipeline_bench.run import AGENTS, Plan, measured, retention  # noqa: E402
from tests.bench.pipeline_bench.stack import TreeStack  # noqa: E402
from tests.bench.proxy_bench.backend import CHAT_OUTPUT_IDS  # noqa: E402
from tests.bench.proxy_bench.stack import ROOT, Stack  # noqa: E402
from tests.bench.trees import baseline_tree, commit_of  # noqa: E402


async def bench(args, stacks: list[TreeStack]) -> list[dict]:
    results = []
    for variant in args.variants:
        plan = Plan(variant, args.sessions, args.group, args.warmup, args.idle)
        for stack in stacks:
            print(f"-- {stack.label}: {variant}, {args.sessions} sessions", file=sys.stderr)
            results.append(await measured(stack, plan))
    if args.profile:
        stack = stacks[-1]
        plan = Plan("noop", args.sessions, args.group, args.warmup, args.idle)
        print(f"-- {stack.label}: noop under py-spy ({', '.join(args.profile)})", file=sys.stderr)
        got = await measured(stack, plan, profile=tuple(args.profile))
        results.append({**got, "variant": "noop under py-spy"})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--variants", nargs="+", choices=list(AGENTS), default=list(AGENTS))
    ap.add_argument("--baseline", metavar="REF", help="also measure this commit, side by side")
    ap.add_argument("--group", type=int, default=10, help="sessions per task")
    ap.add_argument("--warmup", type=int, default=8, help="warm-up sessions before each run")
    ap.add_argument("--idle", type=float, default=3.0, help="seconds of idle stack measured")
    ap.add_argument("--bounds", default="4,4,8", help="max_init,ready_buffer,max_run")
    ap.add_argument(
        "--profile",
        nargs="+",
        metavar="SERVICE",
        default=[],
        help="an extra noop run with py-spy on these services (last tree)",
    )
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    bounds = tuple(int(x) for x in args.bounds.split(","))
    work = Path(tempfile.mkdtemp(prefix="polar-bench-pipeline-"))
    engine = Stack(work, set(os.sched_getaffinity(0)), set(os.sched_getaffinity(0)))
    stacks: list[TreeStack] = []
    with ExitStack() as cleanup:
        cleanup.callback(engine.stop_all)
        engine_url = f"http://127.0.0.1:{engine.start_backend(CHAT_OUTPUT_IDS)}"
        trees = [("after", ROOT)]
        if args.baseline:
            trees.insert(0, ("before", cleanup.enter_context(baseline_tree(args.baseline, work))))
        for label, tree in trees:
            stack = TreeStack(f"{label}: {commit_of(tree)}", tree, work / label)
            cleanup.callback(stack.down)
            stacks.append(stack.up(engine_url, bounds))
            stack.pids["instant engine"] = engine.procs[0].pid
        results = asyncio.run(bench(args, stacks))
        kept = [asyncio.run(retention(s)) for s in stacks]
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": len(os.sched_getaffinity(0)),
        "nice": os.nice(0),
        "bounds": bounds,
        "group": args.group,
    }
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "runs": results, "kept": kept}, indent=2))
    print(report.markdown(meta, results, kept, [s.label for s in stacks]))


if __name__ == "__main__":
    main()
