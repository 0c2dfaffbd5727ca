"""The calculator task (task.yaml) once per harness: the six CLI presets and the shell
agent, all through one stack, with a scripted policy (policy.yaml) so every run passes
the same way; then a results table. ``just example-calculator``.

    python examples/calculator/run.py                       # all seven
    python examples/calculator/run.py --harness pi shell    # some
    python examples/calculator/run.py --max-run 3           # sessions at once
    POLAR_EXAMPLE_KEEP=1 python examples/calculator/run.py  # leave the stack running

The stack (NATS, Valkey, the embedded CPU model server with the scripted policy, proxy
in token mode, scheduler, pool, executor, builder, evaluator) starts on free ports and is
stopped at the end. The CLIs come from the harness cache ($POLAR_HARNESS_CACHE, default
.state/harness-cache, filled by `just setup`); a missing one is installed from npm first.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import sys
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.runner import Run, run_tasks, scripted, stack  # noqa: E402

HERE = Path(__file__).resolve().parent
# cheap ones first: a session waits for the engine while it prefills a CLI's long prompt
HARNESSES = ("shell", "pi", "codex", "claude_code", "gemini_cli", "opencode", "qwen_code")
# CLI prompts are 2k-31k tokens: one prefill chunk, and every session's prompt kept cached
ENGINE = "threads: 2, engine: {max_prefill_tokens: 32768, prefix_cache_tokens: 600000}"


def variant(task: dict, harness: str, run_id: str, scripted: bool = True) -> dict:
    """``task`` for ``harness``: its own id, the harness set, the shell agent's command
    only where it is used, the node's Python first on PATH (the tests run with it), and
    with a scripted policy the marker its script answers to."""
    t = copy.deepcopy(task)
    t["task_id"] = f"{t['task_id']}-{harness.replace('_', '-')}-{run_id}"
    agent = t["agent"]
    agent["harness"] = harness
    if harness != "shell":
        agent.pop("command", None)
    if scripted:
        t["instruction"] = f"[calc:{harness}] {t['instruction']}"
    env = t["runtime"].setdefault("env", {})
    env.setdefault("PATH", f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin")
    if harness == "qwen_code":  # it drops a stream that sends nothing for 240 s and retries;
        # a busy CPU engine's prefill of its 30k-token prompt takes longer (its own error
        # line names this variable)
        agent.setdefault("env", {})["QWEN_STREAM_IDLE_TIMEOUT_MS"] = "1200000"
    return t


def why(session, timeout: float) -> str:
    """The session's own reason when it did not complete (the CLI's error line), else the
    evaluator's."""
    if session is None:
        return f"no result in {timeout:g}s"
    if str(session.state) != "COMPLETED" and session.reason:
        return session.reason
    return session.eval_reason or "tests pass"


def results_table(runs: list[Run], timeout: float) -> Table:
    table = Table(title="calculator: one session per harness (scripted policy)")
    for col in (
        "harness", "version", "protocol", "state", "reward", "evaluator / reason",
        "model calls", "side calls", "INIT s", "agent s", "session s",
    ):  # fmt: skip
        table.add_column(col)
    for r in runs:
        s, traj = r.session, r.trajectory
        side = sorted({t["side_call"] for t in traj.get("traces", []) if t.get("side_call")})
        table.add_row(
            r.task["agent"]["harness"],
            traj.get("harness_version") or "-",
            traj.get("protocol") or "-",
            str(s.state) if s else "no result",
            "-" if s is None or s.reward is None else f"{s.reward:g}",
            why(s, timeout),
            str(traj.get("stats", {}).get("completions", 0)),
            ", ".join(side) or "-",
            str(r.seconds("INITIALIZING", "READY") or "-"),
            str(r.seconds("RUNNING", "POSTRUN") or "-"),
            str(r.wall or "-"),
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--harness", nargs="+", choices=HARNESSES, default=list(HARNESSES))
    parser.add_argument("--max-run", type=int, default=3, help="sessions running at once")
    parser.add_argument("--timeout", type=float, default=1500.0)
    args = parser.parse_args(argv)
    console = Console(width=int(os.environ.get("COLUMNS", "150")))
    task = yaml.safe_load((HERE / "task.yaml").read_text())
    run_id = str(int(time.time()))
    tasks = [variant(task, h, run_id) for h in args.harness]
    console.rule("[bold]calculator x harnesses")
    log = lambda m: console.print(m, highlight=False)  # noqa: E731
    topology = scripted(HERE / "policy.yaml", engine=ENGINE, max_run=args.max_run)
    with stack(topology, log=log) as topo:
        t0 = time.monotonic()
        runs = asyncio.run(run_tasks(topo, tasks, args.timeout))
        console.print(results_table(runs, args.timeout))
        passed = sum(1 for r in runs if r.session and r.session.reward == 1.0)
        console.print(
            f"{passed}/{len(runs)} passed in {time.monotonic() - t0:.0f}s "
            f"({args.max_run} sessions at once)"
        )
    return 0 if passed == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
