"""SWE-bench / SWE-Gym instances as Polar tasks, graded by the ``swebench`` evaluator.

An instance in SWE-bench's own format (``instance_id``, ``repo``, ``base_commit``,
``problem_statement``, ``patch``, ``test_patch``, ``FAIL_TO_PASS``, ``PASS_TO_PASS``,
``version``; swebench >= 5 datasets also carry ``image``, ``eval_script``, ``log_parser``,
``eval_type``) becomes one task: the agent works in the instance's image at ``/testbed``
(the repository at ``base_commit``), its diff is applied in a fresh container of the same
image, the instance's eval script runs there and ``swebench.harness.grading`` grades its
log. Instances without an ``eval_script`` (SWE-Gym, older SWE-bench exports) get one in
SWE-bench's layout from :func:`eval_script_for` (reset the test files, apply the test
patch, run the tests between the markers, reset again). The gold ``patch`` never goes into
the task: the agent sees the problem statement only.

``python -m evaluators.swebench_tasks INSTANCES.jsonl --out tasks.jsonl`` converts a file
(``examples/swebench/README.md`` has the commands for SWE-bench Verified and SWE-Gym).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

EVAL_KEYS = ("instance_id", "repo", "version", "FAIL_TO_PASS", "PASS_TO_PASS", "image")
HEREDOC = "EOF_114329324912"  # SWE-bench's own heredoc delimiter
# SWE-bench's per-repository image names (swebench >= 2.x "instance images"), for
# instances that name none: sweb.eval.x86_64.<id with __ as _1776_>:latest
IMAGE_TEMPLATE = "swebench/sweb.eval.x86_64.{key}:latest"


def patched_test_files(test_patch: str) -> list[str]:
    """The files a test patch touches (``diff --git a/X b/X``), in order."""
    return list(dict.fromkeys(re.findall(r"^diff --git a/(\S+) b/", test_patch, re.M)))


def eval_script_for(
    instance: dict[str, Any], test_cmd: str, workdir: str = "/testbed", pre: str = ""
) -> str:
    """An eval script in SWE-bench's layout for an instance that has none: the test files
    back at ``base_commit``, the test patch applied, ``test_cmd`` over them between the
    markers the grader looks for, the test files reset."""
    files = " ".join(patched_test_files(instance["test_patch"]))
    base = instance["base_commit"]
    lines = [
        "#!/bin/bash",
        "set -uxo pipefail",
        f"cd {workdir}",
        *([pre] if pre else []),
        f"git checkout {base} {files}",
        f"git apply -v - <<'{HEREDOC}'",
        instance["test_patch"].rstrip("\n"),
        HEREDOC,
        ": '>>>>> Start Test Output'",
        f"{test_cmd} {files}",
        ": '>>>>> End Test Output'",
        f"git checkout {base} {files}",
    ]
    return "\n".join(lines) + "\n"


def image_of(instance: dict[str, Any], template: str = IMAGE_TEMPLATE) -> str:
    if instance.get("image"):
        return str(instance["image"])
    return template.format(key=instance["instance_id"].replace("__", "_1776_").lower())


def polar_task(
    instance: dict[str, Any],
    agent: dict[str, Any],
    *,
    test_cmd: str | None = None,
    image_template: str = IMAGE_TEMPLATE,
    num_samples: int = 1,
    agent_timeout_seconds: float = 1800,
    network: str = "host",
) -> dict[str, Any]:
    """The Polar task of one instance (``agent``: the task's ``agent`` object).
    ``network``: the container's; ``host`` lets the agent reach the node's proxy on
    loopback; ``bridge`` needs the node's ``proxy_url`` set to an address containers
    reach; ``none`` suits agents that make no model call (the grading examples)."""
    inst = dict(instance)
    image = image_of(inst, image_template)
    if not inst.get("eval_script"):
        if not test_cmd:
            raise ValueError(
                f"{inst['instance_id']}: no eval_script in the instance; give test_cmd "
                "(e.g. 'python -m pytest -rA') to make one"
            )
        inst["eval_script"] = eval_script_for(inst, test_cmd)
    grading = {k: inst[k] for k in EVAL_KEYS if k in inst}
    grading["image"] = image
    grading["eval_script"] = inst["eval_script"]
    for key in ("log_parser", "eval_type"):
        if inst.get(key):
            grading[key] = inst[key]
    task_id = re.sub(r"[^A-Za-z0-9_-]", "-", inst["instance_id"])[:64]
    return {
        "task_id": task_id,
        "instruction": inst["problem_statement"],
        "num_samples": num_samples,
        "timeout_seconds": agent_timeout_seconds + 1800,
        "agent_timeout_seconds": agent_timeout_seconds,
        "runtime": {"backend": "docker", "image": image, "workdir": "/testbed", "network": network},
        "agent": agent,
        "builder": {"name": "prefix_merging"},
        "evaluator": {
            "name": "swebench",
            "runtime": "fresh",
            "timeout_seconds": 1800,
            "config": {"instance": grading, "reward": "resolved"},
        },
        "metadata": {"instance_id": inst["instance_id"], "repo": inst.get("repo", "")},
    }


def read_instances(path: Path) -> list[dict[str, Any]]:
    """A .json (one instance or a list), .jsonl or .parquet file of instances."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    doc = json.loads(text)
    return doc if isinstance(doc, list) else [doc]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="SWE-bench / SWE-Gym instances -> Polar tasks")
    p.add_argument("instances", type=Path, help=".json, .jsonl or .parquet of instances")
    p.add_argument("--out", type=Path, default=None, help="tasks .jsonl (default: stdout)")
    p.add_argument("--ids", nargs="*", default=None, help="only these instance ids")
    p.add_argument("--harness", default="qwen_code", help="the agent's harness preset")
    p.add_argument("--model", default="polar", help="the served model name")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--test-cmd", default=None, help="for instances without eval_script")
    p.add_argument("--image-template", default=IMAGE_TEMPLATE)
    p.add_argument("--network", choices=("host", "bridge", "none"), default="host")
    args = p.parse_args(argv)
    agent = {"harness": args.harness, "model": args.model}
    rows = []
    for inst in read_instances(args.instances):
        if args.ids and inst["instance_id"] not in args.ids:
            continue
        task = polar_task(
            inst,
            agent,
            test_cmd=args.test_cmd,
            image_template=args.image_template,
            num_samples=args.num_samples,
            network=args.network,
        )
        rows.append(json.dumps(task))
    out = "\n".join(rows) + ("\n" if rows else "")
    if args.out:
        args.out.write_text(out)
        print(f"{len(rows)} tasks -> {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
