"""SWE-Gym-style GRPO at toy size: ``polar train`` (services/trainer) on the example's
SWE-bench-shaped instance. ``just example-swegym-toy``.

    python -m examples.swegym_grpo.run
    python -m examples.swegym_grpo.run --steps 1    # the smoke size `just test` runs

Builds the images (examples/swebench), writes the task templates (the instance as a
Polar task, the demo's stdlib shell agent in the container), starts a stack whose
embedded engine samples freely from a tiny random model (no script), fills toy.yaml with
the stack's addresses and runs ``polar train`` on it. Every step submits a group of
sessions in the instance's container, grades each in a fresh one (swebench), trains on
the group and pushes the new weights to the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from evaluators.swebench_tasks import polar_task
from examples.runner import REPO, stack, train_addresses
from examples.swebench import instance as example
from services.demo.topology import MODEL_NAME, stack_topology
from services.engine.modelinit import init_model_dir

HERE = Path(__file__).resolve().parent
AGENT_PATH = "/root/.polar-agent.py"  # outside /testbed: not part of the session's diff


def template(inst: dict) -> dict:
    """The task template: the instance's task with the demo's shell agent (stdlib only;
    the instance image has python3), its tool calls run in /testbed."""
    # host network: the agent reaches the stack's proxy on the node's loopback
    task = polar_task(inst, {"harness": "shell"}, agent_timeout_seconds=300, network="host")
    task.pop("task_id")
    task.pop("num_samples")
    task["timeout_seconds"] = 900
    task["evaluator"]["timeout_seconds"] = 300
    task["runtime"]["prepare"] = [
        {"action": "upload_file", "src": str(REPO / "infra/demo/agent.py"), "dest": AGENT_PATH}
    ]
    task["agent"] = {"harness": "shell", "command": f"python3 {AGENT_PATH}", "model": MODEL_NAME}
    return task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="toy.yaml's otherwise (2)")
    args = parser.parse_args(argv)
    os.environ.setdefault("CONTAINERS_CONF", "/tmp/polar-podman/containers.conf")
    subprocess.run(
        [REPO / "examples/swebench/build_image.sh"], check=True, stdout=subprocess.DEVNULL
    )
    with tempfile.TemporaryDirectory(prefix="polar-textstats-") as tmp:
        inst = example.make_instance(Path(tmp) / "textstats")
        example.build_image(Path(tmp) / "textstats")
    out = Path(tempfile.mkdtemp(prefix="polar-swegym-toy-"))
    model_dir = init_model_dir(out / "model")  # the tiny random model, trained in place
    tasks = out / "tasks.jsonl"
    tasks.write_text(json.dumps(template(inst)) + "\n")
    with stack(lambda state: stack_topology(state, model_dir, max_run=2, max_batch=8)) as topo:
        cfg = yaml.safe_load((HERE / "toy.yaml").read_text())
        cfg.update(
            **train_addresses(topo),  # the stack's: weight pushes need its admin token
            model_dir=str(model_dir),
            checkpoint_dir=str(out / "ckpt"),
            tasks={"path": str(tasks)},
        )
        if args.steps is not None:
            cfg["steps"] = args.steps
        config = out / "config.json"
        config.write_text(json.dumps(cfg, indent=2))
        print(f"polar train {config}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run(
            [sys.executable, "-m", "services.cli.main", "train", str(config)], cwd=REPO
        ).returncode
        print(f"polar train exited {rc} after {time.monotonic() - t0:.0f}s; log {out}/ckpt")
    return rc


if __name__ == "__main__":
    sys.exit(main())
