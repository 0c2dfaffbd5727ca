"""The trainer through the whole stack: scheduler -> pool -> executor -> a trivial agent
-> proxy -> the embedded engine sampling from a tiny model -> builder -> evaluator ->
the trainer, which steps, checkpoints and pushes its weights back into the engine."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from infra import devstack, localservers
from schemas import subjects as S
from services.cli.context import registered_trainer
from services.client import TrajectoryClient
from services.common.bus import Bus
from services.engine.weights import load_tensors
from services.trainer import checkpoint as ck
from services.trainer.batch import GroupCounts, group_samples
from services.trainer.cli import main as train_main
from services.trainer.config import parse_config
from services.trainer.loop import FAULT_ENV, settings_of
from services.trainer.policy import Policy, train_step
from services.trainer.sync import SyncError, push_weights
from tests.helpers.polar_cli import run_polar
from tests.helpers.procs import ServiceProcess
from tests.helpers.trainer_stack import (
    admin_headers,
    operator_nats,
    stack_credentials,
    start_stack,
    trainer_config,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stack():
    state_dir = Path(tempfile.mkdtemp(prefix="polar-trainer-"))
    topo, model_dir, proxy_url = start_stack(state_dir)
    yield topo, model_dir, proxy_url, state_dir
    report = devstack.down(state_dir)
    assert not report.still_listening


def steps_of(log: Path) -> list[dict]:
    return [r for r in ck.read_log(log) if r["type"] == "step"]


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise TimeoutError(what)


async def test_a_served_run_trains_pushes_versions_and_checks_every_on_policy_step(stack):
    topo, model_dir, proxy_url, state_dir = stack
    out = state_dir / "served"
    cfg = trainer_config(
        topo,
        model_dir,
        proxy_url,
        out,
        run_id="served",
        steps=3,
        keep_checkpoints=1,
        eval={
            "at_start": True,
            "at_end": True,
            "every": 0,
            "overrides": {"agent": {"env": {"POLAR_TEMPERATURE": "0"}}},
        },
    )
    proc = ServiceProcess("services.trainer.main:create_app", cfg, out).start(timeout=60)
    try:

        def done():
            body = httpx.get(f"{proc.url}/healthz", timeout=2).json()
            assert body["checks"]["run"]["ok"], body
            return body["checks"]["run"]["done"]

        await asyncio.to_thread(wait_for, done, 300, "the run to finish")
        metrics = (await asyncio.to_thread(httpx.get, f"{proc.url}/metrics", timeout=2)).text
    finally:
        proc.stop()
    assert "polar_trainer_step 3.0" in metrics
    assert 'polar_trainer_sample_staleness_total{age="0"} 24.0' in metrics
    assert (
        "polar_trainer_logprob_mismatch" in metrics and "polar_trainer_heldout_accuracy" in metrics
    )

    steps = steps_of(out / "ckpt" / "log.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:  # synchronous: every sample is on-policy and every one is checked
        assert r["staleness"] == {"0": r["samples"]} and r["samples"] == 8
        assert r["mismatch_tokens"] == r["sampled_tokens"] > 0
        assert r["mismatch_max"] is not None and r["mismatch_max"] <= 1e-4
        assert r["engine_version"] == str(r["step"])
    print("mismatch per step:", [r["mismatch_max"] for r in steps])
    evals = [r for r in ck.read_log(out / "ckpt" / "log.jsonl") if r["type"] == "eval"]
    assert [(e["step"], e["versions"], e["tasks"]) for e in evals] == [(0, ["0"], 2), (3, ["3"], 2)]
    # the best held-out step is kept (and named by BEST) past keep_checkpoints=1
    top = max(evals, key=lambda e: e["accuracy"])  # a tie keeps the earlier
    assert [e["step"] for e in evals if e.get("best")] == [0] + ([3] if top["step"] == 3 else [])
    assert ck.best(out / "ckpt") == out / "ckpt" / ck.step_name(top["step"])
    kept = {p.name for p in (out / "ckpt").glob("step-*")}
    assert kept == {ck.step_name(top["step"]), "step-000003"}
    _, state = ck.latest(out / "ckpt")
    assert (state.best_step, state.best_accuracy) == (top["step"], top["accuracy"])

    async with httpx.AsyncClient(trust_env=False) as client:
        admin = admin_headers(topo)
        served = (await client.get(f"{proxy_url}/admin/weight_version", headers=admin)).json()
    assert served["weight_version"] == "3"
    base, trained = load_tensors(model_dir), load_tensors(out / "ckpt" / "step-000003")
    moved = [k for k in base if not (base[k] == trained[k]).all()]
    assert len(moved) == len(base)  # every tensor took gradient steps
    assert (out / "ckpt" / "curves.png").stat().st_size > 10_000


async def test_rollouts_ahead_are_stale_and_a_stale_group_is_clipped_as_configured(stack):
    topo, model_dir, proxy_url, state_dir = stack
    out = state_dir / "ahead"
    raw = trainer_config(topo, model_dir, proxy_url, out, run_id="ahead", steps=4, rollout_ahead=2)
    cfg = parse_config(raw)
    assert await asyncio.to_thread(train_main_json, raw, out) == 0
    steps = steps_of(cfg.log_file)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    ages = {k for r in steps for k in r["staleness"]}
    assert "1" in ages  # sampled by the previous version while that step trained
    for r in steps:
        if r["mismatch_tokens"]:
            assert r["mismatch_max"] <= 1e-4

    # the first group (sampled by version 0) against the final weights (version 4)
    async with TrajectoryClient(
        operator_nats(topo), durable="stale-reader", task_ids=["ahead-t0"]
    ) as c:
        group = await asyncio.wait_for(anext(c.groups()), 60)
        await c.delete_consumer()
    samples = group_samples(group.trajectories, 4, "grpo", "auto", GroupCounts())
    assert {s.versions for s in samples} == {("0",)}
    policy = Policy(model_dir, lr=1e-3)
    policy.load(Path(cfg.checkpoint_dir) / "step-000004")
    with torch.no_grad():
        rows = policy.logprobs(samples)
    ratios = [
        float(math.exp(lp - b))
        for row, s in zip(rows, samples, strict=True)
        for lp, b, m in zip(row.tolist(), s.behavior, s.mask, strict=True)
        if m
    ]
    assert max(abs(r - 1) for r in ratios) > 1e-3  # the weights moved: the ratio is not 1
    # an eps in a gap between tokens' deviations (none on the boundary), near the median.
    # 0 and 1 bound the gaps (eps is in (0, 1)): four steps can push most ratios near 0,
    # leaving no gap between two deviations below 1.
    bounds = sorted({0.0, 1.0, *(d for d in (abs(r - 1) for r in ratios) if d < 1)})
    gaps = [i for i in range(1, len(bounds)) if bounds[i] - bounds[i - 1] > 1e-4]
    i = min(gaps, key=lambda i: abs(i - len(bounds) // 2))
    eps = (bounds[i - 1] + bounds[i]) / 2
    settings = settings_of(
        parse_config({**raw, "clip_eps": eps, "max_staleness": 4, "stale_policy": "drop"})
    )
    stats = train_step(policy, samples, 4, settings)
    assert stats.staleness == {"4": len(samples)} and stats.mismatch_max is None
    assert stats.ratio_max == pytest.approx(max(ratios), rel=1e-4)
    expected = sum(
        1
        for row, s in zip(rows, samples, strict=True)
        for lp, b, m in zip(row.tolist(), s.behavior, s.mask, strict=True)
        if m
        and (
            (s.advantage > 0 and math.exp(lp - b) > 1 + eps)
            or (s.advantage < 0 and math.exp(lp - b) < 1 - eps)
            # the dual clip: a negative-advantage token's ratio weight held at the cap
            or (s.advantage < 0 and math.exp(lp - b) > settings.ratio_cap)
        )
    )
    assert expected > 0 and stats.clip_fraction == pytest.approx(expected / len(ratios))
    dropped = train_step(policy, samples, 4, settings_of(parse_config({**raw, "max_staleness": 3})))
    assert dropped.dropped_stale == len(samples) and dropped.trained_samples == 0


def train_main_json(raw: dict, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "trainer.json"
    path.write_text(json.dumps(raw))
    return train_main(str(path))


async def test_the_run_fails_with_a_nonzero_status_above_the_mismatch_threshold(stack, capsys):
    topo, model_dir, proxy_url, state_dir = stack
    out = state_dir / "strict"
    raw = trainer_config(
        topo, model_dir, proxy_url, out, run_id="strict", steps=2, mismatch_threshold=1e-12
    )
    assert await asyncio.to_thread(train_main_json, raw, out) == 3
    assert "logprob mismatch" in capsys.readouterr().err
    log = ck.read_log(out / "ckpt" / "log.jsonl")
    assert [r["type"] for r in log] == ["error"] and "mismatch" in log[0]["error"]
    assert ck.latest(out / "ckpt")[1].step == 0  # nothing was stepped or committed

    # the same run id, started fresh elsewhere, would wait forever on deduplicated tasks
    again = {**raw, "checkpoint_dir": str(out / "other"), "mismatch_threshold": 1e-4}
    assert await asyncio.to_thread(train_main_json, again, out / "again") == 1
    assert "run_id 'strict' was used before" in capsys.readouterr().err
    assert ck.latest(out / "other") is None


async def test_a_weight_push_that_cannot_land_fails_with_the_reason(stack):
    topo, _, proxy_url, state_dir = stack
    token = stack_credentials(topo).admin_token
    async with httpx.AsyncClient(trust_env=False) as client:
        with pytest.raises(SyncError, match="refused .401"):  # no admin token: refused
            await push_weights(client, proxy_url, str(state_dir / "no-such-dir"), "9")
        with pytest.raises(SyncError, match="refused .400"):
            await push_weights(
                client, proxy_url, str(state_dir / "no-such-dir"), "9", admin_token=token
            )
        closed = f"http://127.0.0.1:{localservers.free_port()}"
        with pytest.raises(SyncError, match="unreachable"):
            await push_weights(client, closed, str(state_dir), "9", attempts=2)
        version = await client.get(f"{proxy_url}/admin/weight_version", headers=admin_headers(topo))
        assert version.json()["weight_version"]


def run_trainer(cfg_path: Path, log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "services.trainer", str(cfg_path)],
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


async def test_kill_9_mid_run_resumes_with_no_group_trained_twice_and_none_lost(stack):
    topo, model_dir, proxy_url, state_dir = stack
    out = state_dir / "crash"
    out.mkdir()
    raw = trainer_config(
        topo,
        model_dir,
        proxy_url,
        out,
        run_id="crash",
        steps=6,
        rollout_ahead=1,
        ack_wait_seconds=3.0,
        cancel_on_exit=False,
    )
    cfg_path = out / "trainer.json"
    cfg_path.write_text(json.dumps(raw))
    log = out / "ckpt" / "log.jsonl"
    # 1: killed right after step 2's checkpoint, before its groups are committed
    first = run_trainer(cfg_path, out / "p1.log", {FAULT_ENV: "after_checkpoint:2"})
    assert await asyncio.to_thread(first.wait, 300) == -signal.SIGKILL
    assert ck.latest(out / "ckpt")[1].step == 2
    # 2: kill -9 from outside while it collects step 4
    second = run_trainer(cfg_path, out / "p2.log")
    await asyncio.to_thread(
        wait_for, lambda: any(r["step"] == 3 for r in steps_of(log)), 300, "step 3"
    )
    os.killpg(second.pid, signal.SIGKILL)
    second.wait(30)
    # 3: runs to the end
    third = run_trainer(cfg_path, out / "p3.log")
    assert await asyncio.to_thread(third.wait, 300) == 0, (out / "p3.log").read_text()[-3000:]

    records = ck.read_log(log)
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]  # step 2 restored from its checkpoint
    groups = [g for r in steps for g in r["groups"]]
    assert len(groups) == len(set(groups)) == 12  # no group trained twice
    resumes = [r for r in records if r["type"] == "resume"]
    assert [r["step"] for r in resumes][:1] == [2] and len(resumes) == 2
    # step 2's groups were not committed when the first process died: redelivered, then
    # acked without training because the checkpoint has them
    first_after = next(r for r in steps if r["step"] == 3)
    assert first_after["skipped_trained"] >= 1 or any(r["skipped_trained"] for r in steps[3:])

    _, state = ck.latest(out / "ckpt")
    assert state.step == 6 and sorted(state.trained) == sorted(groups)
    submitted = {f"crash-t{i}" for i in range(state.next_task)}
    assert set(state.trained) | set(state.in_flight) == submitted  # none lost
    assert not set(state.trained) & set(state.in_flight)
    # the run finished: its durable went with it (no backlog left to grow); what is still
    # in flight stays in the stream, for whoever reads those tasks (a longer run resumed
    # from this checkpoint_dir gets it with a new durable)
    bus = await Bus.open(operator_nats(topo), "test-crash-consumers", declare=False)
    names = {c.name for c in await bus.js.consumers_info(S.STREAM_TRAJECTORIES)}
    await bus.close()
    assert "trainer-crash" not in names
    leftover = set(state.in_flight)
    async with TrajectoryClient(
        operator_nats(topo), durable="crash-leftover", task_ids=sorted(leftover), ack_wait=5
    ) as client:
        got = set()

        async def drain():
            async for g in client.groups():
                got.add(g.task_id)
                if leftover <= got:
                    return

        await asyncio.wait_for(drain(), 120)
        await client.delete_consumer()
    assert leftover <= got and not (got & set(state.trained))


async def test_a_served_run_that_fails_the_mismatch_check_ends_its_process(stack):
    topo, model_dir, proxy_url, state_dir = stack
    out = state_dir / "served-strict"
    cfg = trainer_config(
        topo, model_dir, proxy_url, out, run_id="servedstrict", steps=2, mismatch_threshold=1e-12
    )
    proc = ServiceProcess("services.trainer.main:create_app", cfg, out).start(timeout=60)
    try:
        code = await asyncio.to_thread(proc.proc.wait, 300)
    finally:
        proc.stop()
    assert code != 0
    log = ck.read_log(out / "ckpt" / "log.jsonl")
    assert [r["type"] for r in log] == ["error"] and "mismatch" in log[0]["error"]


async def test_polar_train_takes_the_stack_from_its_state_dir_and_leaves_no_consumer(stack):
    """`polar train --state-dir` (or -t) needs nothing copied from credentials.json; the
    run registers its log with the stack (the dashboard's Training page) and, finished,
    deletes its durable consumer: no backlog growing forever in `polar status` (issue
    38.2, 38.4). Its run id stays taken: the stream still holds its trajectories."""
    topo, model_dir, proxy_url, state_dir = stack
    out = state_dir / "cli-run"
    raw = trainer_config(
        topo, model_dir, proxy_url, out, run_id="clirun", steps=1, groups_per_step=1, group_size=2
    )
    for key in ("nats_url", "redis_url", "admin_token", "proxy_url"):
        del raw[key]  # the stack's, from its state dir
    config = out / "train.yaml"
    config.write_text(yaml.safe_dump(raw))

    def polar(*args: str):
        return run_polar(*args, "--state-dir", str(state_dir), timeout=300)

    r = await asyncio.to_thread(polar, "train", str(config))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done: 1 steps" in r.stdout
    record = registered_trainer(state_dir)
    assert record is not None and record.run_id == "clirun"
    assert Path(record.log_path) == (out / "ckpt" / "log.jsonl").resolve()
    # the stack's dashboard finds the foreground run's log, which ends with its "done"
    from services.dashboard.config import DashboardConfig
    from services.dashboard.reader import StackReader
    from services.dashboard.training import parse_jsonl, run_state

    reader = StackReader(DashboardConfig(state_dir=str(state_dir)))
    try:
        assert reader.trainer_log_path() == record.log_path
        assert run_state(parse_jsonl(reader.trainer_log()), None)["state"] == "done"
    finally:
        await reader.stop()

    status = await asyncio.to_thread(polar, "status", "--json")
    report = json.loads(status.stdout)
    consumers = {c["name"] for s in report["streams"] for c in s["consumers"]}
    assert "trainer-clirun" not in consumers, consumers

    config.write_text(yaml.safe_dump({**raw, "checkpoint_dir": str(out / "fresh")}))
    again = await asyncio.to_thread(polar, "train", str(config))
    assert again.returncode == 1
    assert "run_id 'clirun' was used before on this bus (its trajectories" in again.stderr
