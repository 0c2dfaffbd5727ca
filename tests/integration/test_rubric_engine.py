"""``rubric`` with the embedded engine as its judge (the model server the proxy serves
from, as a real process): the judge's scripted verdict per trace, mixed into the base
reward; the judge's calls kept as side calls, and none of them went through the proxy."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from evaluators.base import EvalContext
from evaluators.registry import run_evaluator
from evaluators.rubric import Rubric
from infra.localservers import free_port
from schemas import Artifacts, Outcome, TaskRequest, Trace, Trajectory
from services.engine.modelinit import init_model_dir

JUDGE_POLICY = """
turns:
  - match: "I fixed add"
    text: "The fix is right and the tests were run.\\nSCORE: 9"
  - match: "I gave up"
    text: "Nothing was fixed.\\nSCORE: 1"
default: {text: "no verdict"}
"""


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    model = init_model_dir(root / "model")
    policy = root / "judge.yaml"
    policy.write_text(JUDGE_POLICY)
    port = free_port()
    cmd = [sys.executable, "-m", "services.engine", "--model-dir", str(model), "--port",
           str(port), "--policy", str(policy)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode()[-2000:])
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        yield url + "/v1"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)


def trace(answer: str, i: int) -> Trace:
    return Trace(
        trace_id=f"s/{i}",
        prompt_ids=[1],
        response_ids=[2],
        loss_mask=[1],
        response_logprobs=[-0.1],
        messages=[
            {"role": "user", "content": "Fix calc.py"},
            {"role": "assistant", "content": answer},
        ],
    )


def test_engine_judges_each_trace(judge_url):
    traj = Trajectory(
        session_id="s",
        task_id="t",
        outcome=Outcome.COMPLETED,
        builder="x",
        traces=[trace("I fixed add() and ran pytest", 0), trace("I gave up", 1)],
    )
    config = {
        "url": judge_url,
        "model": "judge",
        "rubric": "Full marks for a correct fix with the tests run.",
        "scale": [0, 10],
        "coefficient": 0.5,
        "base": {"name": "session_completed"},
    }
    task = TaskRequest(instruction="Fix calc.py", task_id="t")
    ctx = EvalContext(traj, Artifacts(), task, config)
    result = asyncio.run(run_evaluator(Rubric(), ctx, 120.0, "rubric"))
    assert result.status == "ok", result.reason
    assert result.details["judge_scores"] == [9.0, 1.0]
    assert result.trace_rewards == pytest.approx((1.45, 1.05))
    assert result.reward == pytest.approx(1.25)
    calls = result.details["judge_calls"]
    assert [c["side_call"] for c in calls] == ["judge", "judge"]
    assert calls[0]["reply"].endswith("SCORE: 9")
