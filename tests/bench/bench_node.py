"""Node benchmarks (issue 5): runtime pool + harness executor on the local runtime.

1. Pipeline throughput with the noop harness (sessions/s) and per-stage overhead: median
   and p99 of REGISTERED -> INITIALIZING -> READY -> RUNNING -> POSTRUN from the event
   log (REGISTERED is the session's creation time).
2. READY-buffer simulation: each session's INIT costs I seconds (prepare action
   ``sleep I``), then its shell harness makes R seconds of calls to a model backend of
   fixed capacity K (a tiny HTTP server here, K requests at once, each ``call`` seconds).
   Run slots = K, so the backend can be kept full; the question is whether INIT keeps
   up. Reports the backend's busy fraction (busy slot-seconds / K x window, window =
   first call to last call) with ``ready_buffer=0`` (just-in-time INIT) and with a
   buffer sized ceil(K * I / R) + K (INITs in flight to match the run rate, plus one
   round of prepared runtimes waiting), ``max_init`` = the buffer.

Own nats-server and Valkey on free ports:
    python tests/bench/bench_node.py [--sessions 200] [--init 10] [--run 4] [--capacity 4]

``--baseline REF [--after REF] [--ab-rounds 3]``: an A/B against another commit in one
run. This script is run from a ``git worktree`` of REF and from this checkout (or of the
``--after`` commit), alternately (the order
flips each round, so both see the same load), each on its own servers; the medians of
its throughputs and backend busy fractions are tabled side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infra import localservers  # noqa: E402
from services.scheduler import logic  # noqa: E402
from tests.bench.trees import ROOT, baseline_tree, commit_of  # noqa: E402
from tests.helpers.node import Node, task  # noqa: E402

STAGES = ["REGISTERED", "INITIALIZING", "READY", "RUNNING", "POSTRUN"]
CALLER = r"""
import sys, time, urllib.request
url, calls = sys.argv[1], int(sys.argv[2])
for _ in range(calls):
    urllib.request.urlopen(url, timeout=60).read()
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Servers:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="polar-bench-node-"))
        self.nport, self.rport = localservers.free_port(), localservers.free_port()
        self.nats = localservers.start_nats(self.nport, self.dir / "nats")
        self.valkey = localservers.start_valkey(self.rport, self.dir / "valkey")

    async def node(self, name: str, **limits) -> Node:
        urls = f"nats://127.0.0.1:{self.nport}", f"redis://127.0.0.1:{self.rport}/0"
        return await Node.start(*urls, self.dir / name, node=name, **limits)

    def close(self) -> None:
        localservers.stop_process(self.nats.pid)
        localservers.stop_process(self.valkey.pid)


async def stage_times(node: Node, task_id: str) -> dict[str, dict[str, float]]:
    """session -> state -> when it was entered."""
    out: dict[str, dict[str, float]] = {}
    for s in await node.registry.task_sessions(task_id):
        out[s.session_id] = {"REGISTERED": s.created_at}
    for ev in await node.events():
        if ev.task_id == task_id:
            out[ev.session_id].setdefault(ev.to_state.value, ev.ts)
    return out


# -- 1. pipeline throughput ------------------------------------------------------------
async def throughput(servers: Servers, n: int, limits: dict) -> None:
    name = "tp{max_init}x{ready_buffer}x{max_run}".format(**limits)
    node = await servers.node(name, **limits)
    try:
        t0 = time.perf_counter()
        await node.scheduler.accept(logic.with_task_id(task(name, n)))  # noop harness
        await node.wait_finished(n, timeout=600)
        wall = time.perf_counter() - t0
        times = await stage_times(node, name)
    finally:
        await node.stop()
    print(f"\n### noop pipeline, {n} sessions, max_init/ready_buffer/max_run = {name[2:]}")
    print(f"throughput: **{n / wall:.1f} sessions/s** ({wall:.1f} s)\n")
    print("| stage | median ms | p99 ms |")
    print("|---|---|---|")
    for a, b in zip(STAGES, STAGES[1:], strict=False):
        d = [t[b] - t[a] for t in times.values() if a in t and b in t]
        print(f"| {a} -> {b} | {statistics.median(d) * 1e3:.0f} | {pct(d, 0.99) * 1e3:.0f} |")


# -- 2. READY-buffer simulation ----------------------------------------------------------
class Backend:
    """K requests served at once, each for ``call`` seconds; tracks busy slot-seconds."""

    def __init__(self, capacity: int, call: float) -> None:
        self.capacity, self.call = capacity, call
        self.slots = asyncio.Semaphore(capacity)
        self.busy = 0.0
        self.first: float | None = None
        self.last = 0.0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/generate"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        async with self.slots:
            start = time.monotonic()
            self.first = start if self.first is None else self.first
            await asyncio.sleep(self.call)
            end = time.monotonic()
            self.busy += end - start
            self.last = max(self.last, end)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    def busy_fraction(self) -> float:
        return self.busy / (self.capacity * (self.last - (self.first or self.last)))

    def reset(self) -> None:
        self.busy, self.first, self.last = 0.0, None, 0.0


async def ready_buffer_run(servers: Servers, backend: Backend, args, buffer: int) -> dict:
    backend.reset()
    k = args.capacity
    limits = dict(max_init=max(k, buffer), ready_buffer=buffer, max_run=k)
    name = f"rb{buffer}"
    node = await servers.node(name, **limits)
    calls = max(1, round(args.run / backend.call))
    spec = task(
        name,
        args.sim_sessions,
        runtime={
            "backend": "local",
            "prepare": [
                {"action": "upload_file", "dest": "caller.py", "content": CALLER},
                {"action": "exec", "command": f"sleep {args.init}"},
            ],
        },
        agent={"command": f"{sys.executable} -I -S caller.py {args.url} {calls}"},
    )
    try:
        t0 = time.perf_counter()
        await node.scheduler.accept(logic.with_task_id(spec))
        await node.wait_finished(args.sim_sessions, timeout=1200)
        wall = time.perf_counter() - t0
        times = await stage_times(node, name)
    finally:
        await node.stop()
    bad = [e for e in node.finished.values() if e.outcome.value != "completed"]
    assert not bad, bad[0]
    run = statistics.mean(t["POSTRUN"] - t["RUNNING"] for t in times.values())
    return {"buffer": buffer, "limits": limits, "busy": backend.busy_fraction(), "wall": wall,
            "run": run}  # fmt: skip


async def ready_buffer(servers: Servers, args) -> None:
    backend = Backend(args.capacity, args.call)
    args.url = await backend.start()
    # INITs in flight to match the run rate (Little: K/R sessions/s x I s), plus a round
    # of K prepared ones waiting, so a slot that frees never waits for an INIT to end.
    sized = math.ceil(args.capacity * args.init / args.run) + args.capacity
    rows = [await ready_buffer_run(servers, backend, args, b) for b in (0, sized)]
    backend.server.close()
    print(
        f"\n### READY buffer: INIT I={args.init:g}s, agent R={args.run:g}s of calls "
        f"({args.call:g}s each) to a backend of capacity K={args.capacity}, "
        f"{args.sim_sessions} sessions, max_run=K"
    )
    print("\n| ready_buffer | max_init | backend busy | wall s | sessions/s | mean RUNNING s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['buffer']} | {r['limits']['max_init']} | **{r['busy']:.1%}** "
            f"| {r['wall']:.1f} | {args.sim_sessions / r['wall']:.2f} | {r['run']:.2f} |"
        )
    jit = args.run / (args.run + args.init)
    own = args.run / rows[-1]["run"]
    print(
        f"\nJust-in-time bound R/(R+I) = {jit:.1%}; sized buffer = ceil(K*I/R) + K. "
        f"The harness calls during R / mean RUNNING = {own:.1%} of its RUNNING time "
        "(its start-up, the gaps between calls, artifacts and runtime stop make the rest)."
    )


async def main(args) -> None:
    servers = Servers()
    try:
        print(f"# Node benchmarks ({time.strftime('%Y-%m-%d %H:%M')})")
        if not args.skip_throughput:
            await throughput(servers, args.sessions, dict(max_init=4, ready_buffer=4, max_run=8))
            await throughput(servers, args.sessions, dict(max_init=8, ready_buffer=8, max_run=16))
        await ready_buffer(servers, args)
    finally:
        servers.close()


# -- A/B against another commit -----------------------------------------------------------
THROUGHPUT = re.compile(r"max_init/ready_buffer/max_run = (\S+)\nthroughput: \*\*([\d.]+) ")
BUSY = re.compile(r"^\| (\d+) \| \d+ \| \*\*([\d.]+)%\*\* \|", re.M)


def measures(report: str) -> dict[str, float]:
    """What one run printed: sessions/s per bounds, backend busy % per READY buffer."""
    got = {f"noop sessions/s, bounds {b}": float(v) for b, v in THROUGHPUT.findall(report)}
    got |= {f"backend busy %, ready_buffer {b}": float(v) for b, v in BUSY.findall(report)}
    return got


def ab(args, passed: list[str]) -> None:
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    with (
        tempfile.TemporaryDirectory(prefix="polar-bench-node-ab-") as tmp,
        baseline_tree(args.baseline, Path(tmp)) as before,
        contextlib.ExitStack() as more,
    ):
        after = (
            more.enter_context(baseline_tree(args.after, Path(tmp), "after"))
            if args.after
            else ROOT
        )
        trees = [("before", before), ("after", after)]
        for r in range(args.ab_rounds):
            for label, tree in trees if r % 2 == 0 else trees[::-1]:
                print(f"-- round {r + 1}: {label}", file=sys.stderr)
                script = tree / "tests" / "bench" / "bench_node.py"
                out = subprocess.run(
                    [sys.executable, str(script), *passed],
                    capture_output=True, text=True, check=True, cwd=tree,
                ).stdout  # fmt: skip
                runs[label].append(measures(out))
        labels = {label: commit_of(tree) for label, tree in trees}
    print(f"# Node benchmark A/B ({time.strftime('%Y-%m-%d %H:%M')}), "
          f"medians of {args.ab_rounds} alternating runs each\n")  # fmt: skip
    for label, commit in labels.items():
        print(f"- {label}: {commit}")
    print("\n| measure | before (runs) | after (runs) | after / before, medians |")
    print("|---|---|---|---|")
    for key in runs["after"][0]:
        b = [run[key] for run in runs["before"] if key in run]
        a = [run[key] for run in runs["after"]]
        each = " ".join  # every run, in order, to show the spread beside the median
        print(
            f"| {key} | {statistics.median(b):.1f} ({each(f'{x:.1f}' for x in b)}) "
            f"| {statistics.median(a):.1f} ({each(f'{x:.1f}' for x in a)}) "
            f"| {statistics.median(a) / statistics.median(b):.2f} |"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=200, help="noop pipeline sessions")
    ap.add_argument("--init", type=float, default=10.0, help="I: INIT cost, seconds")
    ap.add_argument("--run", type=float, default=4.0, help="R: agent's calls, seconds")
    ap.add_argument("--call", type=float, default=0.5, help="seconds per backend call")
    ap.add_argument("--capacity", type=int, default=4, help="K: backend concurrency")
    ap.add_argument("--sim-sessions", type=int, default=16)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--baseline", metavar="REF", help="A/B: also run this commit's bench")
    ap.add_argument("--after", metavar="REF", help="A/B: this commit instead of this checkout")
    ap.add_argument("--ab-rounds", type=int, default=3, help="A/B: runs of each checkout")
    args = ap.parse_args()
    if args.baseline:
        ab_flags = {"--baseline", "--after", "--ab-rounds"}
        argv, passed = sys.argv[1:], []
        while argv:  # what each run gets: every flag but the A/B's own
            flag = argv.pop(0)
            name = flag.split("=", 1)[0]
            if name in ab_flags:
                if "=" not in flag:
                    argv.pop(0)
                continue
            passed.append(flag)
        ab(args, passed)
    else:
        asyncio.run(main(args))
