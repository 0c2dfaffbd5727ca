"""``harbor``: the example Harbor task (examples/harbor/hello-greeting) in a real
container built offline from its environment/Dockerfile: the reference solution scores
1.0, no work 0.0, and a verifier that writes no reward, or garbage, is an evaluator error.
Plus the reward-file rules and the task conversion, without a container."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from evaluators import EvaluatorError
from evaluators.base import EvalContext
from evaluators.harbor import Harbor, build_image, polar_task, read_task, reward_from
from evaluators.registry import run_evaluator
from schemas import Artifacts, Outcome, TaskRequest, Trajectory, decode_strict
from schemas.task import DockerRuntime
from services.runtimes import create_runtime
from tests.helpers.requires import DOCKER_HOST, requires_docker

REPO = Path(__file__).resolve().parents[2]
TASK = REPO / "examples" / "harbor" / "hello-greeting"


def test_reward_files():
    assert reward_from({"reward.json": b'{"reward": 0.5, "style": 1}', "reward.txt": b"1"}) == (
        0.5,
        {"style": 1},
    )
    assert reward_from({"reward.json": None, "reward.txt": b"1\n"}) == (1.0, {})
    assert reward_from({"reward.json": b"0.25"}) == (0.25, {})
    for files, message in (
        ({"reward.json": None, "reward.txt": None}, "wrote no /logs/verifier/reward.txt"),
        ({"reward.txt": b"yes"}, "reward.txt is not a number"),
        ({"reward.json": b"{"}, "reward.json is not JSON"),
        ({"reward.json": b'{"score": 1}'}, "no number under 'reward'"),
        ({"reward.txt": b"nan"}, "the verifier's reward is nan"),
    ):
        with pytest.raises(EvaluatorError, match=message):
            reward_from(files)


def test_task_conversion(tmp_path):
    task = polar_task(TASK, {"harness": "shell", "command": "bash solve.sh"}, image="img:1")
    req = decode_strict(orjson.dumps(task), TaskRequest)
    assert req.instruction.startswith("Create the file `/app/greeting.txt`")
    assert (req.runtime.image, req.runtime.workdir, req.runtime.network) == (
        "img:1",
        "/app",
        "none",
    )
    assert req.agent_timeout_seconds == 300.0 and req.runtime.resources.memory_mb == 1024
    assert req.evaluator.name == "harbor" and req.evaluator.runtime == "live"
    with pytest.raises(EvaluatorError, match="no image"):
        polar_task(TASK, {"harness": "noop"})
    with pytest.raises(EvaluatorError, match="not a Harbor task: no task.toml"):
        read_task(tmp_path)
    separate = tmp_path / "sep"
    shutil.copytree(TASK, separate)
    with (separate / "task.toml").open("a") as f:
        f.write('\n[verifier.environment]\ndocker_image = "x"\n')
    with pytest.raises(EvaluatorError, match="separate verifier environments"):
        read_task(separate)


@pytest.fixture(scope="module")
def image():
    if shutil.which("podman") is None:
        pytest.skip("the image is built with podman: `just setup`")
    env = {**os.environ, "CONTAINERS_CONF": "/tmp/polar-podman/containers.conf"}
    subprocess.run([REPO / "examples" / "swebench" / "build_image.sh"], check=True, env=env)
    os.environ.setdefault("CONTAINERS_CONF", env["CONTAINERS_CONF"])
    return build_image(TASK)


def verify(tmp_path: Path, image: str, name: str, agent: str | None, config=None):
    task = decode_strict(
        orjson.dumps(polar_task(TASK, {"harness": "noop"}, image=image)), TaskRequest
    )
    traj = Trajectory(
        session_id=name, task_id="h", outcome=Outcome.COMPLETED, builder="x", traces=[]
    )
    spec = DockerRuntime(image=image, workdir="/app", network="none")

    async def go():
        rt = create_runtime(spec, name, base_dir=tmp_path, docker_host=DOCKER_HOST)
        await rt.start()
        try:
            if agent:  # what the agent did, in its own container (Harbor's shared mode)
                assert (await rt.exec(agent, timeout=30)).ok
            ctx = EvalContext(traj, Artifacts(), task, config or task.evaluator.config, rt, "live")
            return await run_evaluator(Harbor(), ctx, 60.0, "harbor")
        finally:
            await rt.stop()

    return asyncio.run(go())


@requires_docker
def test_solution_passes_and_nothing_fails(image, tmp_path):
    solve = (TASK / "solution" / "solve.sh").read_text()
    ok = verify(tmp_path, image, "hb-oracle", solve)
    assert (ok.status, ok.reward) == ("ok", 1.0), ok.reason
    assert "2 passed" in ok.details["verifier_log"]
    none = verify(tmp_path, image, "hb-none", None)
    assert (none.status, none.reward) == ("ok", 0.0), none.reason
    assert none.reason == "harbor verifier: reward 0"
    wrong = verify(tmp_path, image, "hb-wrong", "printf 'Hello, Polar' > /app/greeting.txt")
    assert wrong.reward == 0.0 and "1 failed, 1 passed" in wrong.details["verifier_log"]


@requires_docker
def test_verifier_without_a_reward_is_an_error(image, tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test.sh").write_text("#!/bin/bash\necho checked, but wrote nothing\n")
    r = verify(tmp_path, image, "hb-noreward", None, {"tests_dir": str(tests)})
    assert r.status == "error" and r.reward is None
    assert "wrote no /logs/verifier/reward.txt or reward.json (test.sh exit 0)" in r.reason
    (tests / "test.sh").write_text("#!/bin/bash\necho great > /logs/verifier/reward.txt\n")
    r = verify(tmp_path, image, "hb-garbage", None, {"tests_dir": str(tests)})
    assert r.status == "error" and "reward.txt is not a number" in r.reason
