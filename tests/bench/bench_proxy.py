"""Proxy overhead, side by side in one run: direct to the engine, through Polar's proxy
(chat mode and token mode), through LiteLLM's proxy (plain script, issue 4).

    python tests/bench/bench_proxy.py [--requests 2000] [--levels 1,16,64] [--no-litellm]

An instant SGLang-shaped engine (tests/bench/proxy_bench/backend.py) answers at once,
so latency above the direct call is the proxy's own. Polar runs as ``polar serve
proxy`` does (granian, one worker) with capture on: every call is committed to a real
JetStream and its state written to a real Valkey before the reply. The proxy under
test is pinned to one core; engine, load generator, NATS and Valkey to the other.
"req per CPU-s" is requests / CPU seconds the proxy's processes spent in the run (in
brackets: counting NATS and Valkey too): requests per second per fully used core.
Memory per session: the proxy's RSS growth over ``--memory-sessions`` fresh sessions
that each made two calls, divided by their number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.common.registry import Registry  # noqa: E402
from tests.bench.proxy_bench import procs  # noqa: E402
from tests.bench.proxy_bench.backend import MODEL, TEXT  # noqa: E402
from tests.bench.proxy_bench.report import DIRECT, Run, latency_lines, table  # noqa: E402
from tests.bench.proxy_bench.stack import LITELLM_KEY, ROOT, Stack  # noqa: E402
from tests.helpers.stack import running_session  # noqa: E402

CHAT_PATH = "/v1/chat/completions"


def request_body(stream: bool) -> dict:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hello."},
        ],
        "max_tokens": 32,
        "stream": stream,
    }


def load(port: int, paths: list[str], per_path: int, stream: bool, cpus, **kw) -> dict:
    spec = {"port": port, "paths": paths, "per_path": per_path, "stream": stream}
    spec.update(body=request_body(stream), **kw)
    out = subprocess.run(
        [sys.executable, "-m", "tests.bench.proxy_bench.client", json.dumps(spec)],
        capture_output=True,
        check=True,
        cwd=str(ROOT),
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )
    result = json.loads(out.stdout)
    if result["bad"]:
        sys.stderr.write(out.stderr.decode()[-2000:])
    return result


class Bench:
    def __init__(self, args: argparse.Namespace, stack: Stack) -> None:
        self.args, self.stack = args, stack
        self.runs: list[Run] = []
        self.notes: list[str] = []

    def measure(self, target: str, port: int, paths_for, pgid: int | None, headers=None) -> None:
        a, cpus = self.args, self.stack.other_cpus
        for stream in (False, True):
            for c in a.levels:
                paths = paths_for(c)
                load(port, paths, max(1, a.warmup // c), stream, cpus, headers=headers or {})
                cpu0, bus0 = self._cpu(pgid)
                res = load(port, paths, a.requests // c, stream, cpus, headers=headers or {})
                cpu1, bus1 = self._cpu(pgid)
                run = Run(
                    target, stream, c, res["latencies"], res["wall"], res["bad"],
                    cpu=(cpu1 - cpu0) if pgid else None,
                    cpu_with_bus=(cpu1 - cpu0 + bus1 - bus0) if pgid and target != "litellm"
                    else None,
                )  # fmt: skip
                self.runs.append(run)
                print(f"  {target:12} stream={stream!s:5} c={c:3} bad={run.bad} "
                      f"rps={run.rps:.0f} per_cpu={run.per_cpu or 0:.0f}", flush=True)  # fmt: skip

    def _cpu(self, pgid: int | None) -> tuple[float, float]:
        if pgid is None:
            return 0.0, 0.0
        return procs.cpu_seconds(pgid), self.stack.bus_cpu()

    def direct(self, backend_port: int) -> None:
        self.measure(DIRECT, backend_port, lambda c: [CHAT_PATH] * c, None)

    def polar(self, backend_port: int, mode: str, model_dir: Path, src: Path, name: str) -> None:
        a = self.args
        proc, port = self.stack.start_polar(backend_port, mode, model_dir, a.loop, src)
        try:
            tokens = self._sessions(f"bench-{name}", max(a.levels))
            self.measure(name, port, lambda c: [f"/s/{t}{CHAT_PATH}" for t in tokens[:c]], proc.pid)
            self._memory(name, port, proc.pid)
        finally:
            procs.stop(proc)

    def _sessions(self, task_id: str, n: int) -> list[str]:
        async def make() -> list[str]:
            reg = Registry.from_url(self.stack.redis_url)
            try:
                return [s.token for s in await running_session(reg, task_id, n=n)]
            finally:
                await reg.close()

        return asyncio.run(make())

    def _memory(self, name: str, port: int, pgid: int) -> None:
        n = self.args.memory_sessions
        if not n:
            return
        tokens = self._sessions(f"bench-mem-{name}", n)
        before = procs.rss_bytes(pgid)
        paths = [f"/s/{t}{CHAT_PATH}" for t in tokens]
        load(port, paths, 2, False, self.stack.other_cpus, concurrency=64)
        after = procs.rss_bytes(pgid)
        self.notes.append(
            f"{name}: RSS {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB over {n} "
            f"new sessions x 2 calls = {(after - before) / n / 1024:.1f} KiB per session"
        )

    def litellm(self, backend_port: int) -> None:
        proc, port = self.stack.start_litellm(backend_port)
        try:
            auth = {"authorization": f"Bearer {LITELLM_KEY}"}
            self.measure("litellm", port, lambda c: [CHAT_PATH] * c, proc.pid, auth)
        finally:
            procs.stop(proc)


def reply_token_ids(model_dir: Path) -> list[int]:
    from proxy.tokenization import ChatTokenizer

    tok = ChatTokenizer.load(model_dir)
    return tok.encode(TEXT) + [tok.eos_token_ids[0]]


def machine(args) -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln), "?")
    return (
        f"{os.cpu_count()} cores ({cpu}), {platform.python_implementation()} "
        f"{platform.python_version()}; proxy under test on CPU {sorted(args.proxy_cpus)}, "
        f"engine + load generator + NATS + Valkey on CPU {sorted(args.other_cpus)}; "
        f"granian loop {args.loop}; {args.requests} requests per cell after {args.warmup} warm-up"
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--modes", default="chat,token")
    ap.add_argument("--memory-sessions", type=int, default=1000)
    ap.add_argument("--no-litellm", action="store_true")
    ap.add_argument("--loop", default="asyncio", help="granian loop: asyncio | uvloop | rloop")
    ap.add_argument("--proxy-cpus", default="0")
    ap.add_argument("--other-cpus", default="1")
    ap.add_argument("--out", type=Path, help="also write the markdown here")
    ap.add_argument(
        "--baseline", type=Path, help="also run the proxy from this checkout (A/B, same run)"
    )
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    args.proxy_cpus = {int(x) for x in args.proxy_cpus.split(",")}
    args.other_cpus = {int(x) for x in args.other_cpus.split(",")}
    return args


def main() -> None:
    args = parse_args()
    from tests.unit.embedded.tiny import tiny_model_dir

    work = Path(tempfile.mkdtemp(prefix="polar-bench-proxy-"))
    stack = Stack(work, args.proxy_cpus, args.other_cpus)
    bench = Bench(args, stack)
    try:
        stack.start_infra()
        model_dir = tiny_model_dir()
        backend_port = stack.start_backend(reply_token_ids(model_dir))
        bench.direct(backend_port)
        for mode in args.modes.split(","):
            if args.baseline:
                bench.polar(backend_port, mode, model_dir, args.baseline, f"base-{mode}")
            bench.polar(backend_port, mode, model_dir, ROOT, f"polar-{mode}")
        if not args.no_litellm:
            bench.litellm(backend_port)
    finally:
        stack.stop_all()
    targets = [
        f"{who}-{m}"
        for m in args.modes.split(",")
        for who in (("base", "polar") if args.baseline else ("polar",))
    ]
    targets += [] if args.no_litellm else ["litellm"]
    text = "\n\n".join(
        [f"Machine: {machine(args)}", table(bench.runs, targets), latency_lines(bench.runs)]
        + ["\n".join(f"- memory: {n}" for n in bench.notes)]
    )
    print("\n" + text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
