"""SWE-bench-shaped grading inside a real container: the example's offline instance
(examples/swebench/), its image built from Debian packages with podman, the ``swebench``
evaluator in a fresh container of that image applying the session's diff, running the
instance's eval script and grading the log with the ``swebench`` package's own logic.
The gold patch scores 1.0; an empty and a wrong patch 0.0, with the per-test report."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from evaluators.base import EvalContext
from evaluators.registry import run_evaluator
from evaluators.swebench import SweBench
from evaluators.swebench_tasks import polar_task
from schemas import Artifacts, Outcome, TaskRequest, Trajectory, decode_strict
from schemas.task import DockerRuntime
from services.runtimes import create_runtime
from tests.helpers.requires import DOCKER_HOST, requires_docker

pytestmark = [
    requires_docker,
    pytest.mark.skipif(
        shutil.which("podman") is None, reason="the images are built with podman: `just setup`"
    ),
]
pytest.importorskip("swebench")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def instance(tmp_path_factory):
    from examples.swebench import instance as example

    env = {**os.environ, "CONTAINERS_CONF": "/tmp/polar-podman/containers.conf"}
    # the base image from Debian packages (about a minute the first time), then the
    # instance image (the committed repository at /testbed)
    subprocess.run([REPO / "examples" / "swebench" / "build_image.sh"], check=True, env=env)
    repo = tmp_path_factory.mktemp("swe") / "textstats"
    inst = example.make_instance(repo)
    os.environ.setdefault("CONTAINERS_CONF", env["CONTAINERS_CONF"])
    example.build_image(repo)
    return inst, example.wrong_patch(repo)


def grade(tmp_path: Path, inst: dict, diff: str, name: str):
    task = decode_strict(
        orjson.dumps(polar_task(inst, {"harness": "noop"}, network="none")), TaskRequest
    )
    traj = Trajectory(
        session_id=name, task_id=task.task_id, outcome=Outcome.COMPLETED, builder="x", traces=[]
    )
    spec = DockerRuntime(image=inst["image"], workdir="/testbed", network="none")

    async def go():
        rt = create_runtime(spec, name, base_dir=tmp_path, docker_host=DOCKER_HOST)
        await rt.start()
        try:
            ctx = EvalContext(
                traj, Artifacts(diff=diff), task, task.evaluator.config, rt, runtime_kind="fresh"
            )
            return await run_evaluator(SweBench(), ctx, 120.0, "swebench")
        finally:
            await rt.stop()

    return asyncio.run(go())


def test_gold_patch_resolves(instance, tmp_path):
    inst, _ = instance
    r = grade(tmp_path, inst, inst["patch"], "swe-gold")
    assert (r.status, r.reward) == ("ok", 1.0), r.reason
    assert r.details["resolution"] == "RESOLVED_FULL"
    assert r.details["fail_to_pass"] == {"success": inst["FAIL_TO_PASS"], "failure": []}
    assert r.details["pass_to_pass"] == {"success": inst["PASS_TO_PASS"], "failure": []}
    assert r.details["applied"] == "diff"


def test_empty_and_wrong_patches_do_not(instance, tmp_path):
    inst, wrong = instance
    for name, diff in (("swe-empty", ""), ("swe-wrong", wrong)):
        r = grade(tmp_path, inst, diff, name)
        assert (r.status, r.reward) == ("ok", 0.0), (name, r.reason)
        assert r.reason == "swebench: RESOLVED_NO"
        assert r.details["fail_to_pass"] == {"success": [], "failure": inst["FAIL_TO_PASS"]}
        assert r.details["pass_to_pass"]["success"] == inst["PASS_TO_PASS"]


def test_a_patch_that_does_not_apply_is_an_evaluator_error(instance, tmp_path):
    inst, _ = instance
    broken = inst["patch"].replace("return len(text.split", "return len(text.spilt")
    r = grade(tmp_path, inst, broken, "swe-broken")
    assert r.status == "error" and "the session's diff does not apply" in r.reason
