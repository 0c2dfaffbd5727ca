"""SWE-bench-shaped grading through the whole stack: the offline instance
(instance.py) as a Polar task (evaluators/swebench_tasks.py), three sessions in its
container image, each applying one patch as its agent (the gold patch, a wrong one,
none), graded by the ``swebench`` evaluator in a fresh container. ``just example-swebench``.

    python -m examples.swebench.run

Builds polar-swebench:latest from Debian packages first if podman has no such image
(build_image.sh, about a minute), then the instance image (seconds).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from evaluators.swebench_tasks import polar_task
from examples.runner import Run, run_tasks, scripted, stack
from examples.swebench import instance as example

HERE = Path(__file__).resolve().parent
PATCH_PATH = "/root/polar-agent.diff"  # outside /testbed: not part of the session's diff


def variants(inst: dict, wrong: str, run_id: str) -> list[dict]:
    """One task per patch; the agent applies it (the shell harness, no model call)."""
    base = polar_task(inst, {"harness": "noop"}, network="none")  # no model call
    out = []
    for name, patch in (("gold", inst["patch"]), ("wrong", wrong), ("empty", "")):
        t = copy.deepcopy(base)
        t["task_id"] = f"{base['task_id']}-{name}-{run_id}"[:64]
        t["agent_timeout_seconds"], t["timeout_seconds"] = 120, 900
        t["evaluator"]["timeout_seconds"] = 300
        if patch:
            t["runtime"]["prepare"] = [
                {"action": "upload_file", "dest": PATCH_PATH, "content": patch}
            ]
            command = f"git apply {PATCH_PATH} && git status --short"
        else:
            command = "git status --short"
        t["agent"] = {"harness": "shell", "command": command, "model": "polar-tiny"}
        out.append(t)
    return out


def report_table(runs: list[Run]) -> Table:
    table = Table(title=f"{example.INSTANCE_ID}: swebench grading in a fresh container")
    for col in ("patch", "reward", "resolution", "FAIL_TO_PASS", "PASS_TO_PASS", "session s"):
        table.add_column(col)
    for r in runs:
        d = r.trajectory.get("metadata", {}).get("eval_details", {})
        f2p, p2p = d.get("fail_to_pass", {}), d.get("pass_to_pass", {})
        table.add_row(
            r.task["task_id"].split("-")[-2],
            "-" if r.session is None or r.session.reward is None else f"{r.session.reward:g}",
            d.get("resolution") or (r.session.eval_reason if r.session else "no result"),
            f"{len(f2p.get('success', []))} pass / {len(f2p.get('failure', []))} fail",
            f"{len(p2p.get('success', []))} pass / {len(p2p.get('failure', []))} fail",
            str(r.wall or "-"),
        )
    return table


def main() -> int:
    console = Console(width=int(os.environ.get("COLUMNS", "150")))
    os.environ.setdefault("CONTAINERS_CONF", "/tmp/polar-podman/containers.conf")
    console.rule("[bold]SWE-bench-shaped grading")
    t0 = time.monotonic()
    subprocess.run([HERE / "build_image.sh"], check=True, stdout=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory(prefix="polar-textstats-") as tmp:
        repo = Path(tmp) / "textstats"
        inst = example.make_instance(repo)
        wrong = example.wrong_patch(repo)
        example.build_image(repo)
    console.print(f"images ready in {time.monotonic() - t0:.0f}s: {inst['image']}")
    tasks = variants(inst, wrong, str(int(time.time())))
    log = lambda m: console.print(m, highlight=False)  # noqa: E731
    policy = Path(__file__).parents[2] / "infra" / "demo" / "policy.yaml"  # no call is made
    with stack(scripted(policy), log=log) as topo:
        runs = asyncio.run(run_tasks(topo, tasks, 900))
    console.print(report_table(runs))
    for r in runs:
        d = r.trajectory.get("metadata", {}).get("eval_details", {})
        report = {k: d.get(k) for k in ("resolution", "fail_to_pass", "pass_to_pass")}
        console.print(f"{r.task['task_id']}: {json.dumps(report)}", highlight=False)
    expected = [1.0, 0.0, 0.0]
    got = [r.session.reward if r.session else None for r in runs]
    return 0 if got == expected else 1


if __name__ == "__main__":
    sys.exit(main())
