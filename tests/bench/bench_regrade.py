"""``polar regrade`` of N stored sessions (100 by default) with a different evaluator:
the re-graded rewards checked against what each session should get, the tokens checked
byte-identical to the originals, and the throughput.

A demo stack (embedded engine, scripted policy) runs N calculator sessions with the
shell agent, each instruction carrying a ticket number, graded by ``session_completed``.
The real ``polar`` CLI then re-grades the task's sessions with ``TicketEvaluator``: a
custom evaluator that reads only what was stored (the transcript) and rewards
``(ticket % 5) / 4``. Re-grading is timed twice: the first pass stores, the second finds
every trajectory already stored (the stream deduplicates): both are printed.

    python tests/bench/bench_regrade.py [--sessions 100] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from evaluators import EvalContext, EvalResult, Evaluator  # noqa: E402
from examples.runner import run_tasks  # noqa: E402
from infra import devstack  # noqa: E402
from infra.topology import parse_topology  # noqa: E402
from schemas import encode  # noqa: E402
from schemas import subjects as S  # noqa: E402
from services.cli.demo import demo_topology  # noqa: E402
from services.common.bus import Bus  # noqa: E402
from services.export.reader import read_stored  # noqa: E402
from tests.helpers.polar_cli import run_polar  # noqa: E402

TASK = "regrade-bench"
TICKET = re.compile(r"ticket (\d+)")


class TicketEvaluator(Evaluator):
    """(ticket % 5) / 4, the ticket read from the session's first user message."""

    needs_runtime = "none"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        for message in ctx.trajectory.traces[0].messages:
            if message.get("role") == "user" and (m := TICKET.search(str(message["content"]))):
                return EvalResult.ok(expected(int(m.group(1))), f"ticket {m.group(1)}")
        return EvalResult.error("no ticket in the transcript")


def expected(ticket: int) -> float:
    return (ticket % 5) / 4


def task(i: int) -> dict:
    return {
        "task_id": f"{TASK}-{i:03d}",
        "instruction": f"Fix calc.py so its tests pass (ticket {i}). [calc:shell]",
        "timeout_seconds": 300,
        "runtime": {
            "backend": "local",
            "env": {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"},
            "prepare": [
                {"action": "upload_dir", "src": str(ROOT / "infra/demo/calculator"), "dest": "."},
                {
                    "action": "upload_file",
                    "src": str(ROOT / "infra/demo/agent.py"),
                    "dest": ".polar-agent.py",
                },
            ],
        },
        "agent": {"harness": "shell", "command": "python3 .polar-agent.py", "model": "polar-tiny"},
        "builder": {"name": "prefix_merging"},
        "evaluator": {"name": "session_completed"},
    }


async def stored(nats_url: str, stream: str, subject: str) -> dict:
    bus = await Bus.open(nats_url, "bench-regrade", declare=False)
    try:
        return {t.session_id: t async for t, _ in read_stored(bus, stream, subject)}
    finally:
        await bus.close()


def regrade(topology: Path, n: int, concurrency: int) -> tuple[float, str, str]:
    targets = [f"{TASK}-{i:03d}" for i in range(n)]
    started = time.perf_counter()
    r = run_polar(
        "regrade", *targets, "--evaluator", "tests.bench.bench_regrade:TicketEvaluator",
        "--concurrency", str(concurrency), "--topology", str(topology), timeout=600,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    if r.returncode != 0:
        raise SystemExit(f"polar regrade failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    rid = r.stdout.split("(regrade ")[1].split(")")[0]
    return seconds, rid, r.stdout.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    os.environ.setdefault("POLAR_HARNESS_CACHE", str(ROOT / ".state" / "harness-cache"))
    with tempfile.TemporaryDirectory(prefix="bench-regrade-") as tmp:
        root = Path(tmp)
        text = demo_topology(root / "state", ROOT / "examples/calculator/policy.yaml", max_run=4)
        topology = root / "topology.yaml"
        topology.write_text(text)
        topo = parse_topology(text, "bench topology")
        devstack.up(topo, log=lambda _m: None)
        topo = devstack.operator_view(topo)  # with the stack's credentials
        try:
            started = time.perf_counter()
            runs = asyncio.run(run_tasks(topo, [task(i) for i in range(args.sessions)], 900))
            ran = time.perf_counter() - started
            done = sum(r.session is not None and r.session.state == "COMPLETED" for r in runs)
            print(f"{args.sessions} sessions run in {ran:.1f}s ({done} completed)")
            first, rid, summary = regrade(topology, args.sessions, args.concurrency)
            again, _, _ = regrade(topology, args.sessions, args.concurrency)
            originals = asyncio.run(
                stored(topo.nats_url, S.STREAM_TRAJECTORIES, S.ALL_TRAJECTORIES)
            )
            regraded = asyncio.run(stored(topo.nats_url, S.STREAM_REGRADES, S.regrades(rid, ">")))
        finally:
            devstack.down(root / "state")
    wrong = [
        sid for sid, t in regraded.items()
        if t.reward != expected(int(t.task_id.rsplit("-", 1)[1]))
    ]  # fmt: skip
    changed_tokens = [
        sid for sid, t in regraded.items()
        if encode(t.traces) != encode([
            type(x)(**{**{f: getattr(x, f) for f in x.__struct_fields__}, "reward": y.reward})
            for x, y in zip(originals[sid].traces, t.traces, strict=True)
        ])
    ]  # fmt: skip
    print(summary)
    print(f"re-graded {len(regraded)} of {len(originals)} stored sessions")
    print(f"rewards wrong: {len(wrong)} {wrong[:5]}")
    print(f"traces not byte-identical (but for the reward): {len(changed_tokens)}")
    print(
        f"polar regrade, first pass (stores): {first:.2f}s = {len(regraded) / first:.0f} sessions/s"
    )
    print(
        f"polar regrade, again (deduplicated): {again:.2f}s = {len(regraded) / again:.0f} sessions/s"
    )


if __name__ == "__main__":
    main()
