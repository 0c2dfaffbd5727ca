"""A Harbor-format task (hello-greeting/) through the whole stack: converted by
``evaluators.harbor.polar_task``, its environment/Dockerfile built with podman (offline:
the base is the local polar-swebench image), two sessions in that container (the
reference solution as the agent, and an agent that does nothing), each verified by the
``harbor`` evaluator as Harbor does (tests/ at /tests, ``bash /tests/test.sh``, the reward
from /logs/verifier). ``just example-harbor``.

    python -m examples.harbor.run
"""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from evaluators.harbor import build_image, polar_task
from examples.runner import REPO, run_tasks, scripted, stack

TASK = Path(__file__).resolve().parent / "hello-greeting"
SOLVE = "/root/solve.sh"  # outside /app: the agent's copy of the reference solution


def main() -> int:
    console = Console(width=int(os.environ.get("COLUMNS", "150")))
    os.environ.setdefault("CONTAINERS_CONF", "/tmp/polar-podman/containers.conf")
    subprocess.run(
        [REPO / "examples/swebench/build_image.sh"], check=True, stdout=subprocess.DEVNULL
    )
    image = build_image(TASK)
    run_id = str(int(time.time()))
    base = polar_task(TASK, {"harness": "noop"}, image=image)
    tasks = []
    for name, command in (("oracle", f"bash {SOLVE}"), ("idle", "true")):
        t = copy.deepcopy(base)
        t["task_id"] = f"{base['task_id']}-{name}-{run_id}"
        t["runtime"]["prepare"] = [
            {"action": "upload_file", "src": str(TASK / "solution/solve.sh"), "dest": SOLVE}
        ]
        t["agent"] = {"harness": "shell", "command": command, "model": "polar-tiny"}
        tasks.append(t)
    policy = REPO / "infra/demo/policy.yaml"  # no model call is made
    with stack(scripted(policy), log=lambda m: console.print(m, highlight=False)) as topo:
        runs = asyncio.run(run_tasks(topo, tasks, 600))
    table = Table(title=f"Harbor task {TASK.name} (image {image})")
    for col in ("agent", "state", "reward", "evaluator says", "verifier log (tail)"):
        table.add_column(col)
    for r in runs:
        s = r.session
        log = r.trajectory.get("metadata", {}).get("eval_details", {}).get("verifier_log", "")
        table.add_row(
            r.task["task_id"].split("-")[-2],
            str(s.state) if s else "no result",
            "-" if s is None or s.reward is None else f"{s.reward:g}",
            (s.eval_reason or "-") if s else "-",
            log.strip().splitlines()[-1] if log.strip() else "-",
        )
    console.print(table)
    got = [r.session.reward if r.session else None for r in runs]
    return 0 if got == [1.0, 0.0] else 1


if __name__ == "__main__":
    sys.exit(main())
