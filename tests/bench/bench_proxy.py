"""Proxy overhead, side by side in one run: direct to the engine, through Polar's proxy
(chat mode and token mode), through LiteLLM's proxy (plain script, issue 4) and through
rLLM's model gateway (the token-capturing proxy of rLLM, issue 18).

    python tests/bench/bench_proxy.py [--requests 1000] [--levels 1,16,64] [--no-litellm]
                                      [--no-rllm] [--unique-prompts]

An instant SGLang-shaped engine (tests/bench/proxy_bench/backend.py; vLLM-shaped on
``/vllm/v1``) answers at once, so latency above the direct call is the proxy's own.
Polar runs as ``polar serve proxy`` does (``proxy.io.native`` on uvloop when installed;
``--loops asyncio`` forces asyncio's loop; a ``--baseline`` checkout from before it
under granian), with capture on: every call is committed to a real JetStream and its
state written to a real Valkey before the reply. LiteLLM's proxy (its own venv, see
stack.py) passes the same OpenAI requests through to the same engine. rLLM's gateway (its own venv too) takes
them on ``/sessions/<id>/v1``, asks the engine's vLLM face for token ids and logprobs and
stores each call's trace (ids, logprobs, messages) in SQLite, as it does by default; the
run checks afterwards that one session's traces hold the ids and logprobs the engine sent.

All proxies run at once, pinned to one core (idle unless under load); the engine, the
load generator, NATS and Valkey share the other. Each cell (streaming or not, number of
concurrent sessions) is measured in ``--rounds`` rounds that take every path in turn,
so load from anything else on the machine falls on all of them alike.
"req per CPU-s" is requests / CPU seconds the proxy's processes spent in its rounds (in
brackets: counting NATS and Valkey too): requests per second per fully used core. CPU
is read from each process's CPU clock, to the nanosecond (``procs.cpu_seconds``).
Memory per session (proxies with sessions: Polar's and rLLM's): the proxy's RSS growth
over ``--memory-sessions`` fresh sessions that each made two calls, divided by their number.
By default every request carries the same body. ``--unique-prompts`` makes every
request's user message new (`` (request <tag>-<n>)`` appended, never repeated: see
proxy_bench/client.py) on every path and in every section (warm-up, cells, first calls,
memory), so a proxy's caches of tokenized prompt pieces miss as they would on
never-seen user text; the Machine line says so.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.common.registry import Registry  # noqa: E402
from tests.bench.proxy_bench import procs  # noqa: E402
from tests.bench.proxy_bench.backend import CHAT_OUTPUT_IDS, MODEL, PROMPT_IDS, TEXT  # noqa: E402
from tests.bench.proxy_bench.report import (  # noqa: E402
    DIRECT,
    FIRST_CALLS,
    LITELLM,
    RLLM,
    Run,
    table,
    verdicts,
)
from tests.bench.proxy_bench.stack import LITELLM_KEY, ROOT, Stack  # noqa: E402
from tests.helpers.stack import running_session  # noqa: E402

CHAT_PATH = "/v1/chat/completions"
UNIQUE = "UNIQUE PROMPTS (--unique-prompts): a never-seen user message in every request; "


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
    out = subprocess.run(  # the spec on stdin: thousands of session paths outgrow argv
        [sys.executable, "-m", "tests.bench.proxy_bench.client"],
        input=json.dumps(spec).encode(),
        capture_output=True,
        cwd=str(ROOT),
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )
    if out.returncode != 0:
        sys.stderr.write(out.stderr.decode()[-3000:])
        raise RuntimeError(f"the load generator failed on port {port} (exit {out.returncode})")
    result = json.loads(out.stdout)
    if result["bad"]:
        sys.stderr.write(out.stderr.decode()[-2000:])
    return result


@dataclass
class Target:
    """One path to the engine: where to send, as whom, whose CPU to count."""

    name: str
    port: int
    paths: list[str]  # one per session (enough for the highest level)
    headers: dict[str, str] = field(default_factory=dict)
    pgid: int | None = None  # the proxy's process group (None: direct)
    with_bus: bool = False  # its capture costs NATS and Valkey CPU too
    fresh_paths: Callable[[str, int], list[str]] | None = None  # (tag, n): n new sessions' paths


@dataclass
class Cell:
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    bad: int = 0
    cpu: float = 0.0
    bus: float = 0.0


class Bench:
    def __init__(self, args: argparse.Namespace, stack: Stack) -> None:
        self.args, self.stack = args, stack
        self.targets: list[Target] = []
        self.runs: list[Run] = []
        self.notes: list[str] = []

    def load(self, port: int, paths: list[str], per_path: int, stream: bool, **kw) -> dict:
        """``load`` on the load generator's cores, with ``--unique-prompts`` applied."""
        if self.args.unique_prompts:
            kw["unique"] = True
        return load(port, paths, per_path, stream, self.stack.other_cpus, **kw)

    def run_all(self) -> None:
        for stream in (False, True):
            for c in self.args.levels:
                self._cell(stream, c)

    def _cell(self, stream: bool, c: int) -> None:
        a = self.args
        cells = {t.name: Cell() for t in self.targets}
        for t in self.targets:
            self.load(t.port, t.paths[:c], max(1, a.warmup // c), stream, headers=t.headers)
        per_round = max(1, a.requests // a.rounds // c)
        for i in range(a.rounds):
            shift = i % len(self.targets)  # a different order each round
            for t in self.targets[shift:] + self.targets[:shift]:
                self._round(t, cells[t.name], stream, c, per_round)
        for t in self.targets:
            cell = cells[t.name]
            self.runs.append(
                Run(
                    t.name,
                    stream,
                    c,
                    cell.latencies,
                    cell.wall,
                    cell.bad,
                    cpu=cell.cpu if t.pgid else None,
                    cpu_with_bus=cell.cpu + cell.bus if t.with_bus else None,
                )  # fmt: skip
            )
            r = self.runs[-1]
            print(f"  stream={stream!s:5} c={c:3} {t.name:20} bad={r.bad} rps={r.rps:6.0f} "
                  f"per_cpu={r.per_cpu or 0:5.0f}", flush=True)  # fmt: skip

    def _round(self, t: Target, cell: Cell, stream: bool, c: int, per_path: int, paths=None, **kw):
        cpu0, bus0 = self._cpu(t)
        paths = paths or t.paths[:c]
        res = self.load(t.port, paths, per_path, stream, headers=t.headers, **kw)
        cpu1, bus1 = self._cpu(t)
        cell.latencies += res["latencies"]
        cell.wall += res["wall"]
        cell.bad += res["bad"]
        cell.cpu += cpu1 - cpu0
        cell.bus += bus1 - bus0

    def _cpu(self, t: Target) -> tuple[float, float]:
        if t.pgid is None:
            return 0.0, 0.0
        return procs.cpu_seconds(t.pgid), self.stack.bus_cpu() if t.with_bus else 0.0

    # -- the paths ---------------------------------------------------------------------

    def add_direct(self, backend_port: int) -> None:
        self.targets.append(Target(DIRECT, backend_port, [CHAT_PATH] * max(self.args.levels)))

    def add_polar(self, backend_port: int, mode: str, loop: str, model_dir: Path, src: Path):
        name = ("base-" if src != ROOT else "polar-") + mode
        name += "" if loop == "serve" else f"+{loop}"
        proc, port = self.stack.start_polar(backend_port, mode, model_dir, loop, src)
        paths = self._polar_paths(f"bench-{name}", max(self.args.levels))
        target = Target(name, port, paths, pgid=proc.pid, with_bus=True)
        target.fresh_paths = self._polar_paths
        self.targets.append(target)

    def add_litellm(self, backend_port: int) -> None:
        proc, port = self.stack.start_litellm(backend_port)
        auth = {"authorization": f"Bearer {LITELLM_KEY}"}
        paths = [CHAT_PATH] * max(self.args.levels)
        self.targets.append(Target(LITELLM, port, paths, auth, pgid=proc.pid))

    def add_rllm(self, backend_port: int) -> None:
        proc, port = self.stack.start_rllm(backend_port)
        paths = rllm_paths(f"bench-{RLLM}", max(self.args.levels))
        self.targets.append(Target(RLLM, port, paths, pgid=proc.pid, fresh_paths=rllm_paths))

    def _polar_paths(self, task_id: str, n: int) -> list[str]:
        """``n`` running sessions of a new task, registered in Valkey as a node would."""

        async def make() -> list[str]:
            reg = Registry.from_url(self.stack.redis_url)
            try:
                return [s.token for s in await running_session(reg, task_id, n=n)]
            finally:
                await reg.close()

        return [f"/s/{tok}{CHAT_PATH}" for tok in asyncio.run(make())]

    def first_calls(self) -> None:
        """Calls spaced like a real harness's: every call is a session's first, so the
        session lookup misses the proxy's cache (one call at a time, one connection)."""
        n, rounds = self.args.first_calls, self.args.rounds
        with_sessions = [t for t in self.targets if t.fresh_paths] if n else []
        fresh = {t.name: t.fresh_paths(f"first-{t.name}", n) for t in with_sessions}
        cells = {t.name: Cell() for t in with_sessions}
        for i in range(rounds):
            shift = i % max(1, len(with_sessions))
            for t in with_sessions[shift:] + with_sessions[:shift]:
                paths = fresh[t.name][i * n // rounds : (i + 1) * n // rounds]
                self._round(t, cells[t.name], False, 1, 1, paths, one_connection=True)
        for t in with_sessions:
            c = cells[t.name]
            self.runs.append(
                Run(f"{t.name} {FIRST_CALLS}", False, 1, c.latencies, c.wall, c.bad, cpu=c.cpu,
                    cpu_with_bus=c.cpu + c.bus if t.with_bus else None)
            )  # fmt: skip

    def memory(self) -> None:
        """RSS growth per fresh session (each making two calls), proxies with sessions."""
        n = self.args.memory_sessions
        for t in self.targets:
            if not n or not t.fresh_paths:
                continue
            paths = t.fresh_paths(f"bench-mem-{t.name}", n)
            before = procs.rss_bytes(t.pgid)
            self.load(t.port, paths, 2, False, concurrency=64)
            after = procs.rss_bytes(t.pgid)
            self.notes.append(
                f"memory per session, {t.name}: RSS {before / 2**20:.1f} -> "
                f"{after / 2**20:.1f} MiB over {n} new sessions x 2 calls = "
                f"{(after - before) / n / 1024:.1f} KiB per session"
            )

    def rllm_capture(self) -> None:
        """What rLLM's gateway stored for its first session: the engine's ids and
        logprobs on every call, or the comparison is not of like with like."""
        t = next((t for t in self.targets if t.name == RLLM), None)
        if t is None:
            return
        session_id = t.paths[0].split("/")[2]
        url = f"http://127.0.0.1:{t.port}/sessions/{session_id}/traces"
        traces = httpx.get(url, timeout=60).json()
        whole = [
            tr
            for tr in traces
            if tr["prompt_token_ids"] == PROMPT_IDS
            and tr["completion_token_ids"] == CHAT_OUTPUT_IDS
            and len(tr["logprobs"] or []) == len(CHAT_OUTPUT_IDS)
        ]
        streamed = sum(1 for tr in traces if tr["raw_request"].get("stream"))
        self.notes.append(
            f"{RLLM}'s capture, session {session_id}: {len(traces)} traces ({streamed} streamed), "
            f"{len(whole)} of them with the engine's {len(PROMPT_IDS)} prompt ids, "
            f"{len(CHAT_OUTPUT_IDS)} output ids and {len(CHAT_OUTPUT_IDS)} logprobs"
        )


def rllm_paths(tag: str, n: int) -> list[str]:
    """``n`` new sessions of rLLM's gateway: it makes a session on its first call."""
    return [f"/sessions/{tag}-{i}{CHAT_PATH}" for i in range(n)]


def reply_token_ids(model_dir: Path) -> list[int]:
    from services.common.tokenization import ChatTokenizer

    tok = ChatTokenizer.load(model_dir)
    return tok.encode(TEXT) + [tok.eos_token_ids[0]]


def machine(args) -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln), "?")
    return (
        f"{os.cpu_count()} cores ({cpu}), {platform.python_implementation()} "
        f"{platform.python_version()}; proxies under test on CPU {sorted(args.proxy_cpus)}, "
        f"engine + load generator + NATS + Valkey on CPU {sorted(args.other_cpus)}; "
        f"{args.requests} requests per cell in {args.rounds} rounds after {args.warmup} "
        f"warm-up; {UNIQUE if args.unique_prompts else ''}"
        f"load average (1 min) {args.load_before} before, {_load()} after"
    )


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--modes", default="chat,token")
    ap.add_argument(
        "--loops", default="serve", help="serve (uvloop, as polar serve proxy), or asyncio"
    )
    ap.add_argument("--memory-sessions", type=int, default=1000)
    ap.add_argument("--first-calls", type=int, default=300, help="first calls of fresh sessions")
    ap.add_argument("--no-litellm", action="store_true")
    ap.add_argument("--no-rllm", action="store_true", help="leave out rLLM's model gateway")
    ap.add_argument(
        "--unique-prompts",
        action="store_true",
        help="a different user message in every request, on every path (default: one body)",
    )
    ap.add_argument("--proxy-cpus", default="0")
    ap.add_argument("--other-cpus", default="1")
    ap.add_argument("--out", type=Path, help="also write the markdown here")
    ap.add_argument("--baseline", type=Path, help="also run the proxy from this checkout (A/B)")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    args.modes, args.loops = args.modes.split(","), args.loops.split(",")
    args.proxy_cpus = {int(x) for x in args.proxy_cpus.split(",")}
    args.other_cpus = {int(x) for x in args.other_cpus.split(",")}
    args.load_before = _load()
    return args


def main() -> None:
    args = parse_args()
    from tests.unit.engine.tiny import tiny_model_dir

    work = Path(tempfile.mkdtemp(prefix="polar-bench-proxy-"))
    stack = Stack(work, args.proxy_cpus, args.other_cpus)
    bench = Bench(args, stack)
    try:
        stack.start_infra()
        model_dir = tiny_model_dir()
        backend_port = stack.start_backend(reply_token_ids(model_dir))
        bench.add_direct(backend_port)
        for mode in args.modes:
            for loop in args.loops:
                for src in [args.baseline, ROOT] if args.baseline else [ROOT]:
                    bench.add_polar(backend_port, mode, loop, model_dir, src)
        if not args.no_litellm:
            bench.add_litellm(backend_port)
        if not args.no_rllm:
            bench.add_rllm(backend_port)
        bench.run_all()
        bench.rllm_capture()
        bench.first_calls()
        bench.memory()
    finally:
        stack.stop_all()
    notes = bench.notes + verdicts(bench.runs)
    text = "\n\n".join(
        [f"Machine: {machine(args)}", table(bench.runs), "\n".join(f"- {n}" for n in notes)]
    )
    print("\n" + text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
