"""verl on Polar: verl's own agent-loop machinery (the real ``verl`` 0.9.1, from its own
venv: ``just setup verl``) drives ``PolarAgentLoop`` over a whole stack with the
embedded engine, which verl's router (``PolarRouter``) hands to Polar's proxy as if it
were a server verl started. What verl received is checked against Polar's own
trajectories, token for token (tests/helpers/verl_driver.py does verl's side)."""

from __future__ import annotations

import asyncio
import json
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from infra import devstack, localservers, verl
from infra.topology import parse_topology
from schemas import Trajectory
from services.client import TrajectoryClient
from services.trainer.adapters.verl_sessions import main_trace
from tests.helpers.trainer_stack import model_copy, operator_nats, stack_credentials

pytestmark = [pytest.mark.timeout(300)]
HELPERS = Path(__file__).resolve().parents[1] / "helpers"
SCORE = Path(__file__).resolve().parents[1] / "fixtures" / "trainer" / "score.py"
CHAT_AGENT = SCORE.parent / "agent.py"  # the trainer tests' one-call agent
SERVICES = ("model", "scheduler", "pool", "executor", "builder", "evaluator")


def topology(state_dir: Path, model_dir: Path, proxy_port: int) -> str:
    """A stack without a proxy of its own: verl's router starts it on ``proxy_port``,
    where the node's sandboxes call it."""
    ports = {name: localservers.free_port() for name in ("nats", "redis", *SERVICES)}
    node = f"{{work_dir: '{state_dir / 'work'}', proxy_url: 'http://127.0.0.1:{proxy_port}'}}"
    model = f"{{model_dir: '{model_dir}', served_model_name: tiny, weight_version: '0'}}"
    return f"""
nats_url: nats://127.0.0.1:{ports["nats"]}
redis_url: redis://127.0.0.1:{ports["redis"]}/0
state_dir: '{state_dir}'
startup_timeout_seconds: 120
nodes: [{{name: node0, max_init: 12, ready_buffer: 12, max_run: 12}}]
backends: []
services:
  model: {{port: {ports["model"]}, config: {model}}}
  proxy: {{enabled: false}}
  scheduler: {{port: {ports["scheduler"]}}}
  pool: {{port: {ports["pool"]}, config: {node}}}
  executor: {{port: {ports["executor"]}, config: {node}}}
  builder: {{port: {ports["builder"]}}}
  evaluator: {{port: {ports["evaluator"]}, config: {node}}}
  dashboard: {{enabled: false}}
"""


def task_template() -> dict:
    """Every prompt's task: the test agent (one chat call) in a local sandbox, scored by
    the trainer fixture's score.py (a reward in [0, 1) per distinct answer)."""
    python = sys.executable
    return {
        "timeout_seconds": 120,
        "agent_timeout_seconds": 60,
        "max_retries": 0,
        "infra_retries": 0,
        "runtime": {
            "backend": "local",
            "prepare": [
                {
                    "action": "upload_file",
                    "src": str(HELPERS / "verl_agent.py"),
                    "dest": "agent.py",
                },
                {"action": "upload_file", "src": str(CHAT_AGENT), "dest": "chat_agent.py"},
                {"action": "upload_file", "src": str(SCORE), "dest": "score.py"},
            ],
        },
        "agent": {
            "harness": "shell",
            "command": f"{python} agent.py",
            "model": "tiny",
            "env": {"VERL_TEST_MODE": "ok", "POLAR_MAX_TOKENS": "6"},
        },
        "builder": {"name": "prefix_merging"},
        "evaluator": {"name": "command", "config": {"command": f"{python} score.py"}},
    }


def read_line(proc: subprocess.Popen, timeout: float) -> dict:
    """The driver's next JSON line on stdout (its stderr goes to the test's log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("{"):
                return json.loads(line)
            if not line and proc.poll() is not None:
                break
    proc.kill()
    raise AssertionError(f"verl driver gave no answer (exit {proc.poll()})")


async def trajectories(nats_url: str) -> dict[str, Trajectory]:
    """Every trajectory the stack delivered, by session (Polar's own record)."""
    out = {}
    async with TrajectoryClient(nats_url, durable="verl-test-check", poll_seconds=0.5) as c:
        async for item in c.trajectories(stop_when_idle=True):
            out[item.trajectory.session_id] = item.trajectory
    return out


@pytest.fixture(scope="module")
def verl_run():
    if problem := verl.installed_problem():
        pytest.skip(f"verl's venv cannot be used: {problem}")
    driver = subprocess.Popen(  # verl's imports (~5 s) overlap the stack's start
        [str(verl.venv_python()), str(HELPERS / "verl_driver.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=verl.run_env(),
        cwd=verl.REPO,
    )
    state_dir = Path(tempfile.mkdtemp(prefix="polar-verl-"))
    model_dir = model_copy(state_dir / "model")
    proxy_port = localservers.free_port()
    topo = parse_topology(topology(state_dir, model_dir, proxy_port), "verl test")
    t0 = time.monotonic()
    try:
        devstack.up(topo)
        up = time.monotonic() - t0
        creds = stack_credentials(topo)
        read_line(driver, 60)  # imported
        args = {
            "nats_url": operator_nats(topo),
            "env_file": str(devstack.env_file(state_dir)),
            "python": sys.executable,
            "proxy_port": proxy_port,
            "engine": f"127.0.0.1:{topo.services['model'].port}",
            "admin_token": creds.admin_token,
            "engine_key": creds.engine_key,  # the embedded engine's (verl's have none)
            "model_dir": str(model_dir),
            "task": task_template(),
        }
        driver.stdin.write(json.dumps(args) + "\n")
        driver.stdin.flush()
        result = read_line(driver, 180)
        answered = time.monotonic() - t0
        result["polar"] = asyncio.run(trajectories(operator_nats(topo)))
        result["seconds"] = {"up": up, "answered": answered, "read": time.monotonic() - t0}
        yield result
    finally:
        driver.kill()  # its proxy goes with it (PolarRouter: PR_SET_PDEATHSIG)
        driver.wait(timeout=30)
        devstack.down(state_dir)


def by_prompt(rows: list[dict], name: str) -> list[dict]:
    return [r for r in rows if r["uid"] == f"uid-{name}"]


def test_a_group_reaches_verl_token_for_token(verl_run):
    """The sound group: 3 sessions of one task, each as verl padded it into its batch,
    exactly the session's main trace (ids, loss mask, logprobs) and its reward."""
    rows, polar = verl_run["legacy"]["rows"], verl_run["polar"]
    group = by_prompt(rows, "sound")
    assert len(group) == 3
    assert len({r["extra"]["polar_task_id"] for r in group}) == 1  # one Polar task
    note = []
    for row in group:
        t = polar[row["extra"]["polar_session_id"]]
        trace = main_trace(t)
        assert row["prompt_ids"] == trace.prompt_ids
        assert row["response_ids"] == trace.response_ids
        assert row["response_mask"] == trace.loss_mask
        assert row["rollout_log_probs"] == pytest.approx(trace.response_logprobs, abs=1e-6)
        assert (
            row["rm_score"] == pytest.approx(t.reward) and row["extra"]["polar_reward"] == t.reward
        )
        assert row["extra"]["min_global_steps"] == row["extra"]["max_global_steps"] == 0
        assert row["shapes"]["prompts"][1] == 256 and row["shapes"]["responses"][1] == 64
        note.append(
            f"{t.session_id}: prompt {len(row['prompt_ids'])} ids, response "
            f"{len(row['response_ids'])} ids, mask {sum(row['response_mask'])}/"
            f"{len(row['response_mask'])}, logprobs {len(row['rollout_log_probs'])}, "
            f"reward {t.reward}, advantage {row['advantage']:+.4f}"
        )
    print("verl received, a 3-session group:\n  " + "\n  ".join(note))
    print("timings:", json.dumps(verl_run["timings"]), "whole test", verl_run["seconds"])


def test_verls_loss_takes_a_cpu_step_on_the_batch_verl_built(verl_run):
    """verl's trainer cannot start without a GPU (docs/training.md, "verl"), so the step
    is taken by hand: the weights the engine served recompute the response logprobs
    (they match Polar's captured ones), verl's PPO clipped loss over verl's GRPO
    advantages, one AdamW step, and the loss falls."""
    step = verl_run["legacy"]["cpu_step"]
    print("a CPU step with verl's loss:", json.dumps(step))
    assert step["max_logprob_drift"] < 1e-3 and abs(step["ppo_kl"]) < 1e-4
    assert step["tokens"] > 0 and step["loss_after"] < step["loss"]


def test_a_failed_session_leaves_its_group(verl_run):
    """V1 trainer: the failed run raises, verl settles the group as ``failure`` and its
    baseline is the two members that came back. Legacy trainer: a masked row at their
    mean reward (the group's mean does not move; it trains on nothing)."""
    v1 = verl_run["v1"]
    assert v1["status"] == "failure" and len(v1["kept"]) == 2
    assert len(v1["errors"]) == 1 and "PolarSessionFailed" in v1["errors"][0]
    assert "-0001" in v1["errors"][0] and "failed" in v1["errors"][0]
    rewards = [k["reward"] for k in v1["kept"]]
    mean, std = sum(rewards) / 2, abs(rewards[0] - rewards[1]) / 2**0.5
    for k in v1["kept"]:
        assert k["keys"] == sorted(
            ["prompts", "responses", "response_mask", "rollout_log_probs", "rm_scores"]
            + ["extra_fields", "metrics", "num_turns"]
        )
        assert len(k["response_mask"]) == len(k["rollout_log_probs"]) == k["responses"]
        assert k["extra_fields"]["min_global_steps"] == k["extra_fields"]["max_global_steps"] == 7
        assert k["extra_fields"]["polar_version_spans"] == [["7", 0, k["responses"]]]
        expected = (k["reward"] - mean) / (std + 1e-6) if std else 0.0
        assert k["advantage"] == pytest.approx(expected, abs=1e-4)

    group = by_prompt(verl_run["legacy"]["rows"], "failing")
    failed = [r for r in group if r["extra"].get("polar_excluded")]
    kept = [r for r in group if not r["extra"].get("polar_excluded")]
    assert len(failed) == 1 and len(kept) == 2
    assert failed[0]["extra"]["polar_session_id"].endswith("-0001")
    assert failed[0]["extra"]["polar_outcome"] == "error"
    assert failed[0]["response_mask"] == [0] and failed[0]["advantage"] == 0.0
    assert failed[0]["rm_score"] == pytest.approx(sum(r["rm_score"] for r in kept) / 2)


def test_a_timed_out_session_stays_and_a_cancelled_group_leaves(verl_run):
    """A timeout keeps what it sampled, at reward 0 by rule (it judges the policy); a
    group cancelled in Polar comes back all masked, training on nothing."""
    rows, polar = verl_run["legacy"]["rows"], verl_run["polar"]
    for row in by_prompt(rows, "timeout"):
        t = polar[row["extra"]["polar_session_id"]]
        assert t.outcome == "timeout" and row["extra"]["polar_outcome"] == "timeout"
        assert row["rm_score"] == 0.0 and sum(row["response_mask"]) > 0
        assert row["response_ids"] == main_trace(t).response_ids
    cancelled = by_prompt(rows, "cancelled")
    assert len(cancelled) == 3
    for row in cancelled:
        assert row["extra"]["polar_outcome"] == "cancelled"
        assert row["extra"]["polar_task_id"] == verl_run["legacy"]["cancelled_task"]
        assert row["response_mask"] == [0] and row["advantage"] == 0.0


def test_the_adapter_imports_only_polars_client_side(verl_run):
    """In verl's venv the adapter loads ``schemas`` and ``services.client`` (with the
    ``services.common`` modules the client itself imports) and nothing else of Polar."""
    modules = verl_run["modules"]
    own = {
        "services.trainer",
        "services.trainer.adapters",
        "services.trainer.adapters.verl_agent_loop",
        "services.trainer.adapters.verl_sessions",
    }
    client_side = ("schemas", "services.client", "services.common.")
    packages = own | {"services", "services.common"}
    stray = [m for m in modules if m not in packages and not m.startswith(client_side)]
    assert stray == [] and "services.client" in modules, stray
