"""The ``rubric`` evaluator through the whole stack: the calculator task (shell agent,
scripted) scored by its tests (``test_on_output``, the base reward) plus an LLM judge's
score with coefficient 0.5, the judge being the engine the proxy itself serves from (the
embedded model server's ``/v1``, its script holding the judge's verdict). Then the same
task with a judge that answers garbage: an evaluator error, not a 0. Each session's
model calls are read back from ``polar.completions.<session>``: the harness's, then the
judge's, tagged ``side_call: judge``, which no trajectory holds.
``just example-rubric``.

    python -m examples.rubric.run
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml
from rich.console import Console

from examples.calculator.run import variant
from examples.runner import REPO, run_tasks, scripted, stack

CALCULATOR = REPO / "examples" / "calculator"
RUBRIC = "Full marks when the agent found the bug, fixed it in calc.py and ran the tests."
# The judge's verdicts, as the engine's script: matched on the judge's prompt
JUDGE_TURNS = [
    {"match": r"\[judge:garbage\]", "text": "I would rather not grade this."},
    {"match": r"# Rubric", "text": "The bug was found and fixed, and the tests ran.\nSCORE: 9"},
]


def policy_file(dest: Path) -> Path:
    """The calculator's script with the judge's turns first."""
    script = yaml.safe_load((CALCULATOR / "policy.yaml").read_text())
    script["turns"] = JUDGE_TURNS + script["turns"]
    dest.write_text(yaml.safe_dump(script, sort_keys=False))
    return dest


def rubric_task(task: dict, judge_url: str, name: str, rubric: str) -> dict:
    t = copy.deepcopy(task)
    t["task_id"] = f"{t['task_id']}-{name}"
    base = t["evaluator"]
    t["evaluator"] = {
        "name": "rubric",
        "runtime": base["runtime"],
        "config": {
            "url": judge_url,
            "model": "polar-tiny",
            "rubric": rubric,
            "scale": [0, 10],
            "coefficient": 0.5,
            "base": {"name": base["name"], "config": base["config"]},
            "timeout_seconds": 120,
            # the stack's engine wants its key: `polar up` gives the evaluator it there
            "api_key_env": "POLAR_ENGINE_API_KEY",
        },
    }
    return t


def main() -> int:
    console = Console(width=int(os.environ.get("COLUMNS", "150")))
    task = variant(
        yaml.safe_load((CALCULATOR / "task.yaml").read_text()), "shell", str(int(time.time()))
    )
    policy = policy_file(Path(tempfile.mkdtemp(prefix="polar-rubric-")) / "policy.yaml")
    log = lambda m: console.print(m, highlight=False)  # noqa: E731
    with stack(scripted(policy), log=log) as topo:
        judge = f"http://127.0.0.1:{topo.services['model'].port}/v1"
        tasks = [
            rubric_task(task, judge, "judged", RUBRIC),
            rubric_task(task, judge, "garbage", "[judge:garbage] " + RUBRIC),
        ]
        runs = asyncio.run(run_tasks(topo, tasks, 900))
        calls = asyncio.run(model_calls(topo, [r.session.session_id for r in runs if r.session]))
    for r in runs:
        s, meta = r.session, r.trajectory.get("metadata", {})
        details = meta.get("eval_details", {})
        console.print(
            f"[bold]{r.task['task_id']}[/bold]: state {s.state}, reward {s.reward}, "
            f"eval_status {r.trajectory.get('eval_status')}, reason {s.eval_reason!r}",
            highlight=False,
        )
        traces = r.trajectory.get("traces", [])
        console.print(f"  trace rewards: {[t.get('reward') for t in traces]}", highlight=False)
        for key in ("judge_scores", "base_reward", "coefficient", "judge_calls"):
            if key in details:
                console.print(f"  {key}: {json.dumps(details[key])}", highlight=False)
        records = calls.get(s.session_id, []) if s else []
        in_traces = sorted(seq for t in traces for seq in t.get("completion_seqs", []))
        console.print(f"  completion seqs in the trajectory's traces: {in_traces}", highlight=False)
        console.print("  the session's records (polar.completions.<session>):", highlight=False)
        for rec in records:
            console.print(f"    {record_line(rec)}", highlight=False)
    judged, garbage = runs
    ok = (
        abs((judged.session.reward or 0) - 1.45) < 1e-9
        and garbage.trajectory.get("eval_status") == "error"
        and all(judge_records_apart(r, calls) for r in runs)
    )
    return 0 if ok else 1


async def model_calls(topo, session_ids: list[str]) -> dict[str, list]:
    """Each session's CompletionRecords, as the dashboard reads them."""
    from services.common.bus import Bus
    from services.common.completions import read_completions

    bus = await Bus.open(topo.nats_url, "polar-example", declare=False)
    try:
        return {sid: (await read_completions(bus, sid))[0] for sid in session_ids}
    finally:
        await bus.close()


def record_line(rec) -> str:
    reply = json.loads(bytes(rec.reply)) if bytes(rec.reply) != b"null" else None
    text = (reply or {}).get("content") or ""
    return (
        f"seq {rec.seq}: side_call {rec.side_call}, model {rec.model!r}, "
        f"tokens {len(rec.output_ids)} out, error {rec.error}, reply {text[-60:]!r}"
    )


def judge_records_apart(run, calls: dict[str, list]) -> bool:
    """The judge's calls are the session's last records, tagged, in no trace."""
    if run.session is None:
        return False
    records = calls.get(run.session.session_id, [])
    judge = {r.seq for r in records if r.side_call == "judge"}
    harness = {r.seq for r in records if r.side_call != "judge"}
    in_traces = {q for t in run.trajectory.get("traces", []) for q in t.get("completion_seqs", [])}
    return bool(judge) and min(judge) > max(harness, default=-1) and not judge & in_traces


if __name__ == "__main__":
    sys.exit(main())
