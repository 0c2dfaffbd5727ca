"""``harbor``: tasks in the Harbor format, verified as Harbor verifies them.

A Harbor task is a directory (harborframework.com/docs/tasks)::

    task.toml         # [metadata], [agent] timeout_sec, [verifier] timeout_sec / env,
                      # [environment] docker_image / cpus / memory_mb / allow_internet
    instruction.md    # what the agent is told
    environment/      # Dockerfile (its WORKDIR is where the agent works; /app by default)
    tests/test.sh     # the verifier: writes /logs/verifier/reward.txt (a number) or
                      # /logs/verifier/reward.json ({"reward": 1.0, ...})
    solution/solve.sh # optional reference solution (the "oracle")

Harbor's default verifier mode is "shared": after the agent, ``tests/`` is copied to
``/tests`` in the agent's container and ``bash /tests/test.sh`` runs there. This evaluator
does the same in the session's runtime (``evaluator.runtime: live``; a docker runtime:
the script's paths are absolute), then reads reward.json (its ``reward`` key, or
``reward_key``), else reward.txt. No reward file, an unreadable one or a verifier past its
timeout is an evaluator error, never a 0. ``separate`` verifier environments are not
supported (the task is refused with that reason).

Config: ``task_dir`` (the task directory, on the node) or ``tests_dir``; ``env``;
``timeout_seconds``; ``reward_key``. :func:`polar_task` makes the whole Polar task;
``python -m evaluators.harbor TASK_DIR [--image TAG] [--build]`` prints it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evaluators.base import EvalContext, EvalResult, Evaluator, EvaluatorError
from evaluators.workspace import command_timeout, tail

REWARD_DIR = "/logs/verifier"
TESTS_DIR = "/tests"


@dataclass(frozen=True)
class HarborTask:
    path: Path
    name: str
    instruction: str
    config: dict[str, Any]
    workdir: str  # the Dockerfile's last WORKDIR, /app when it names none

    def section(self, name: str) -> dict[str, Any]:
        value = self.config.get(name, {})
        return value if isinstance(value, dict) else {}


def read_task(path: Path) -> HarborTask:
    """The Harbor task at ``path``; raises EvaluatorError naming what is missing."""
    for required in ("task.toml", "instruction.md", "tests/test.sh"):
        if not (path / required).is_file():
            raise EvaluatorError(f"{path} is not a Harbor task: no {required}")
    try:
        config = tomllib.loads((path / "task.toml").read_text())
    except tomllib.TOMLDecodeError as exc:
        raise EvaluatorError(f"{path}/task.toml: {exc}") from None
    verifier = config.get("verifier", {})
    if isinstance(verifier, dict) and (
        verifier.get("environment_mode") == "separate" or "environment" in verifier
    ):
        raise EvaluatorError(f"{path}: separate verifier environments are not supported")
    workdir = "/app"
    dockerfile = path / "environment" / "Dockerfile"
    if dockerfile.is_file():
        found = re.findall(r"^\s*WORKDIR\s+(\S+)", dockerfile.read_text(), re.M | re.I)
        workdir = found[-1] if found else workdir
    return HarborTask(
        path=path,
        name=path.name,
        instruction=(path / "instruction.md").read_text(),
        config=config,
        workdir=workdir,
    )


def reward_from(files: dict[str, bytes | None], key: str = "reward") -> tuple[float, dict]:
    """(reward, every named value) from what the verifier wrote; reward.json first."""
    raw = files.get("reward.json")
    if raw is not None:
        try:
            doc = json.loads(raw)
        except ValueError:
            raise EvaluatorError(f"reward.json is not JSON: {raw[:200]!r}") from None
        if isinstance(doc, int | float) and not isinstance(doc, bool):
            doc = {key: doc}
        if not isinstance(doc, dict) or not isinstance(doc.get(key), int | float):
            raise EvaluatorError(f"reward.json has no number under {key!r}: {raw[:200]!r}")
        value = float(doc[key])
        extra = {k: v for k, v in doc.items() if k != key}
    else:
        raw = files.get("reward.txt")
        if raw is None:
            raise EvaluatorError(f"the verifier wrote no {REWARD_DIR}/reward.txt or reward.json")
        try:
            value, extra = float(raw.decode().strip()), {}
        except (UnicodeDecodeError, ValueError):
            raise EvaluatorError(f"reward.txt is not a number: {raw[:200]!r}") from None
    if not math.isfinite(value):
        raise EvaluatorError(f"the verifier's reward is {value!r}")
    return value, extra


def tests_dir_of(config: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The tests directory and the task's [verifier] section, from the config."""
    if config.get("task_dir"):
        task = read_task(Path(str(config["task_dir"])))
        return task.path / "tests", task.section("verifier")
    if config.get("tests_dir"):
        path = Path(str(config["tests_dir"]))
        if not (path / "test.sh").is_file():
            raise EvaluatorError(f"{path} has no test.sh")
        return path, {}
    raise EvaluatorError("harbor config needs task_dir (a Harbor task) or tests_dir")


class Harbor(Evaluator):
    name = "harbor"
    needs_runtime = "task"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        tests, verifier = tests_dir_of(ctx.config)
        runtime = ctx.require_runtime()
        env = {str(k): str(v) for k, v in (verifier.get("env") or {}).items()}
        env.update({str(k): str(v) for k, v in (ctx.config.get("env") or {}).items()})
        timeout = command_timeout(
            ctx, ctx.config.get("timeout_seconds", verifier.get("timeout_sec"))
        )
        clean = await runtime.exec(
            f"rm -rf {TESTS_DIR} {REWARD_DIR} && mkdir -p {TESTS_DIR} {REWARD_DIR}", timeout=30
        )
        if not clean.ok:
            raise EvaluatorError(
                f"cannot make {TESTS_DIR} and {REWARD_DIR} in the runtime (Harbor tasks need "
                f"a container runtime): {tail(clean.stderr or clean.stdout, 500)}"
            )
        await runtime.upload_dir(tests, TESTS_DIR)
        run = await runtime.exec(
            f"bash {shlex.quote(TESTS_DIR + '/test.sh')} 2>&1", env=env, timeout=timeout
        )
        log = tail(run.stdout, 3000)
        if run.timed_out:
            raise EvaluatorError(f"the verifier timed out after {timeout:.0f}s: {log}")
        files = {}
        for name in ("reward.json", "reward.txt"):
            probe = await runtime.exec(f"test -f {REWARD_DIR}/{name}", timeout=30)
            files[name] = await runtime.download(f"{REWARD_DIR}/{name}") if probe.ok else None
        try:
            reward, extra = reward_from(files, str(ctx.config.get("reward_key", "reward")))
        except EvaluatorError as exc:
            raise EvaluatorError(f"{exc} (test.sh exit {run.exit_code}): {log}") from None
        return EvalResult.ok(
            reward,
            None if reward >= 1.0 else f"harbor verifier: reward {reward:g}",
            verifier_exit=run.exit_code,
            verifier_log=log,
            **({"rewards": extra} if extra else {}),
        )


def polar_task(
    task_dir: Path,
    agent: dict[str, Any],
    *,
    image: str | None = None,
    num_samples: int = 1,
) -> dict[str, Any]:
    """The Polar task of a Harbor task: its instruction, its container (``image``, else
    ``[environment].docker_image``), its timeouts, and this evaluator in the live runtime."""
    task = read_task(task_dir.resolve())
    env_cfg, agent_cfg, verifier = (task.section(s) for s in ("environment", "agent", "verifier"))
    image = image or env_cfg.get("docker_image")
    if not image:
        raise EvaluatorError(f"{task_dir}: no image: build environment/ (--build) or give --image")
    agent_timeout = float(agent_cfg.get("timeout_sec", 600.0))
    verifier_timeout = float(verifier.get("timeout_sec", 600.0))
    resources = {}
    if env_cfg.get("cpus"):
        resources["cpus"] = float(env_cfg["cpus"])
    if env_cfg.get("memory_mb"):
        resources["memory_mb"] = int(env_cfg["memory_mb"])
    return {
        "task_id": re.sub(r"[^A-Za-z0-9_-]", "-", task.name)[:64],
        "instruction": task.instruction,
        "num_samples": num_samples,
        "timeout_seconds": agent_timeout + verifier_timeout + 600,
        "agent_timeout_seconds": agent_timeout,
        "runtime": {
            "backend": "docker",
            "image": image,
            "workdir": task.workdir,
            "network": "bridge" if env_cfg.get("allow_internet", True) else "none",
            **({"resources": resources} if resources else {}),
        },
        "agent": agent,
        "builder": {"name": "prefix_merging"},
        "evaluator": {
            "name": "harbor",
            "runtime": "live",
            "timeout_seconds": verifier_timeout + 60,
            "config": {"task_dir": str(task.path)},
        },
        "metadata": {"harbor_task": task.name, **task.section("metadata")},
    }


def build_image(task_dir: Path, tag: str | None = None, engine: str = "podman") -> str:
    """``environment/`` built into an image (the Dockerfile's own base must be at hand)."""
    tag = tag or f"polar-harbor-{task_dir.resolve().name}:latest"
    subprocess.run(
        [engine, "build", "--pull=never", "-q", "-t", tag, str(task_dir / "environment")],
        check=True,
        capture_output=True,
        text=True,
    )
    return tag


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a Harbor task directory -> a Polar task (JSON)")
    p.add_argument("task_dir", type=Path)
    p.add_argument("--image", default=None, help="the container image (default: task.toml's)")
    p.add_argument("--build", action="store_true", help="build environment/ with podman first")
    p.add_argument("--harness", default="shell")
    p.add_argument("--command", default=None, help="the shell harness's command")
    p.add_argument("--model", default="polar")
    p.add_argument("--num-samples", type=int, default=1)
    args = p.parse_args(argv)
    image = build_image(args.task_dir, args.image) if args.build else args.image
    agent: dict[str, Any] = {"harness": args.harness, "model": args.model}
    if args.command:
        agent["command"] = args.command
    task = polar_task(args.task_dir, agent, image=image, num_samples=args.num_samples)
    print(json.dumps(task, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
