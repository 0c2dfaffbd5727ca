"""``polar replay`` through the whole stack (issue 35): the calculator task run once by the
shell agent (its tool call fixes calc.py and runs the tests, the evaluator runs them again
in the agent's runtime), its session then re-run from the record by the real ``polar`` CLI:

* a fork (``--until 1``): the first call answered from the record, the second by the
  engine; one chain, the replayed call's tokens masked, the live one's trained;
* a full replay with the engine stopped first: the same tool call, the same fix, the same
  reward, every call answered from the record and marked so;
* the agent's system prompt edited between the run and the replay (a new harness
  version), the task replayed (each of its sessions): the replay diverges at call 0,
  naming ``messages[0].content`` and quoting both sides, and the CLI exits 4.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from examples.runner import run_tasks
from infra import devstack, localservers
from infra.stackstate import read_state
from infra.topology import parse_topology
from schemas import CompletionRecord, Outcome, Trajectory, encode
from schemas import subjects as S
from services.builder.strategies.prefix_merging import PrefixMerging
from services.bundle.pack import unpack
from services.cli.context import Stack
from services.cli.demo import demo_topology
from services.cli.main import _dashboard_key
from services.common.bus import Bus
from services.common.completions import read_completions
from services.export.reader import read_stored
from tests.helpers.polar_cli import run_polar
from tests.helpers.requires import requires_bwrap

pytestmark = [requires_bwrap, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
CALCULATOR = REPO / "examples" / "calculator"
AGENT = (REPO / "infra" / "demo" / "agent.py").read_text()
SYSTEM = "You are a careful coding agent. Use the bash tool."
MENTIONS = "tests.helpers.regrade_evaluators:Mentions"  # reads only what was stored


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    state_dir = root / "state"
    text = demo_topology(state_dir, CALCULATOR / "policy.yaml", max_run=2)
    topology = root / "topology.yaml"
    topology.write_text(text)
    topo = parse_topology(text, "replay test topology")
    os.environ.setdefault("POLAR_HARNESS_CACHE", str(REPO / ".state" / "harness-cache"))
    devstack.up(topo, log=lambda _m: None)
    try:
        yield devstack.operator_view(topo), topology, state_dir, root
    finally:
        devstack.down(state_dir)


def calculator_task(agent: Path) -> dict:
    return {
        "task_id": "replay-calc",
        "instruction": "The calculator's tests fail. Find the bug in calc.py and fix it. [calc:shell]",
        "timeout_seconds": 300,
        "runtime": {
            "backend": "local",
            # the tests run with this Python (pytest is in its venv)
            "env": {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"},
            "prepare": [
                {"action": "upload_dir", "src": str(REPO / "infra/demo/calculator"), "dest": "."},
                {"action": "upload_file", "src": str(agent), "dest": ".polar-agent.py"},
            ],
        },
        "agent": {"harness": "shell", "command": "python3 .polar-agent.py", "model": "polar-tiny"},
        "builder": {"name": "prefix_merging"},
        "evaluator": {
            "name": "test_on_output",
            "runtime": "live",  # the agent's own runtime, where its tool call fixed calc.py
            "config": {"test_command": "python3 -m pytest -rA -q -p no:cacheprovider tests"},
        },
    }


@pytest.fixture(scope="module")
def recorded(stack):
    topo, _, _, root = stack
    agent = root / "agent.py"  # the node reads it at each session's INIT: editable later
    agent.write_text(AGENT)
    [run] = asyncio.run(run_tasks(topo, [calculator_task(agent)], timeout=240))
    assert run.session is not None and run.session.state == "COMPLETED", run.result
    assert run.session.reward == 1.0
    return run.session.session_id, agent


def polar(stack, *args: str, timeout: float = 240):
    _, topology, _, _ = stack
    return run_polar(*args, "--topology", str(topology), timeout=timeout, columns=400)


async def records_of(topo, session_id: str) -> list[CompletionRecord]:
    bus = await Bus.open(topo.nats_url, "test-replay", declare=False)
    try:
        records, problems = await read_completions(bus, session_id)
    finally:
        await bus.close()
    assert not problems
    return records


def replay_session(stdout: str) -> str:
    """The replay task's session, from the CLI's "replaying ... as task T" line."""
    line = next(x for x in stdout.splitlines() if x.startswith("replaying "))
    return line.split(" as task ")[1].split(":")[0] + "-0000"


def test_a_fork_replays_the_first_call_and_samples_the_rest(stack, recorded):
    topo = stack[0]
    session_id, _ = recorded
    r = polar(stack, "replay", session_id, "--until", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "replayed 1 call(s) from the record" in r.stdout
    assert "then 1 live call(s) from the engine" in r.stdout
    records = asyncio.run(records_of(topo, replay_session(r.stdout)))
    assert [rec.replay is not None for rec in records] == [True, False]
    assert records[0].replay.session_id == session_id and records[0].replay.seq == 0
    assert records[1].extends_previous is True  # the live call extends the replayed tokens
    [chain], _, _ = PrefixMerging().build(records, {}, Outcome.COMPLETED)
    n0 = len(records[0].output_ids)
    assert set(chain.loss_mask[:n0]) == {0} and 1 in chain.loss_mask[n0:]


def test_a_full_replay_needs_no_engine_and_gets_the_same_reward(stack, recorded):
    topo, _, state_dir, _ = stack
    session_id, _ = recorded
    [model] = [p for p in read_state(state_dir).procs if p.name == "model"]
    localservers.stop_process(model.pid)  # no engine from here on
    r = polar(stack, "replay", session_id)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "replayed 2 call(s) from the record" in r.stdout and "live" not in r.stdout
    assert "outcome COMPLETED (recorded COMPLETED), reward 1.0 (recorded 1.0)" in r.stdout
    original = asyncio.run(records_of(topo, session_id))
    replayed = asyncio.run(records_of(topo, replay_session(r.stdout)))
    assert [x.output_ids for x in replayed] == [x.output_ids for x in original]
    replies = [[orjson.loads(bytes(x.reply)) for x in recs] for recs in (replayed, original)]
    assert replies[0] == replies[1] and replies[0][0]["tool_calls"]  # its ids too
    [chain], _, _ = PrefixMerging().build(replayed, {}, Outcome.COMPLETED)
    assert not chain.trainable  # a replay is not trained on unless asked (--train)


async def stored(topo, stream: str, subject: str) -> list[Trajectory]:
    bus = await Bus.open(topo.nats_url, "test-regrade", declare=False)
    try:
        return [t async for t, _ in read_stored(bus, stream, subject)]
    finally:
        await bus.close()


def regrade_id(stdout: str) -> str:
    return stdout.split("(regrade ")[1].split(")")[0]


def test_a_regrade_from_artifacts_keeps_the_tokens_and_both_rewards(stack, recorded, tmp_path):
    topo = stack[0]
    session_id, _ = recorded
    config = '{"needle": "POLAR-FIXED-shell", "reward": 0.25}'
    r = polar(stack, "regrade", "replay-calc", "--evaluator", MENTIONS, "--config", config)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "re-graded 1 of 1 stored session(s)" in r.stdout and "1 reward(s) changed" in r.stdout
    rid = regrade_id(r.stdout)
    [original] = asyncio.run(stored(topo, S.STREAM_TRAJECTORIES, S.trajectories("replay-calc")))
    [again] = asyncio.run(stored(topo, S.STREAM_REGRADES, S.regrades(rid, ">")))
    assert again.session_id == session_id and again.reward == 0.25
    assert encode(again.traces[0].prompt_ids) == encode(original.traces[0].prompt_ids)
    assert [(t.response_ids, t.loss_mask) for t in again.traces] == [
        (t.response_ids, t.loss_mask) for t in original.traces
    ]
    own, new = again.grades
    assert (own.evaluator, own.reward, own.regrade_id) == ("test_on_output", 1.0, None)
    assert (new.evaluator, new.reward, new.via, new.regrade_id) == (
        MENTIONS,
        0.25,
        "artifacts",
        rid,
    )
    # the same evaluator and config again: the same re-grade, stored once
    assert (
        polar(stack, "regrade", session_id, "--evaluator", MENTIONS, "--config", config).returncode
        == 0
    )
    assert len(asyncio.run(stored(topo, S.STREAM_REGRADES, S.regrades(rid, ">")))) == 1
    out = tmp_path / "regraded.jsonl"
    r = polar(
        stack,
        "export",
        "-o",
        str(out),
        "--layout",
        "slime",
        "--regrade",
        rid,
        "--task",
        "replay-calc",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [orjson.loads(line) for line in out.read_text().splitlines()]
    assert {row["reward"] for row in rows} == {0.25} and rows[0]["session_id"] == session_id
    # an evaluator that cannot be made is refused before anything is stored
    r = polar(stack, "regrade", session_id, "--evaluator", "no_such_evaluator")
    assert r.returncode == 1 and "no_such_evaluator" in r.stderr


def test_a_regrade_that_needs_a_runtime_replays_the_session_into_one(stack, recorded):
    topo = stack[0]  # the engine is stopped (above): the replay needs none
    session_id, _ = recorded
    fixed_test = '{"command": "grep -c \\"return a + b\\" calc.py"}'
    r = polar(stack, "regrade", session_id, "--evaluator", "command", "--config", fixed_test)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "command needs a runtime: replaying 1 session(s)" in r.stdout
    assert f"{session_id}: reward 1.0 -> 1.0" in r.stdout
    [again] = asyncio.run(stored(topo, S.STREAM_REGRADES, S.regrades(regrade_id(r.stdout), ">")))
    new = again.grades[-1]
    assert (new.evaluator, new.reward, new.via) == ("command", 1.0, "replay")
    assert new.replay_session and new.replay_session != session_id


def test_the_dashboard_lists_a_sessions_replays_forks_and_regrades(stack, recorded):
    _, topology, _, _ = stack
    session_id, _ = recorded
    operator = Stack.load(topology, None)
    url = operator.service_url("dashboard")
    headers = {"Authorization": f"Bearer {_dashboard_key(operator)}"}

    def lineage() -> dict:
        r = httpx.get(f"{url}/api/sessions/{session_id}", headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["lineage"]

    seen = lineage()
    for _ in range(300):  # the dashboard follows the registry and the stream as they come
        if len(seen["replays"]) >= 3 and len(seen["regrades"]) >= 2:
            break
        time.sleep(0.2)
        seen = lineage()
    kinds = sorted(r["kind"] for r in seen["replays"])
    assert kinds == ["fork after 1 call(s)", "replay", "replay"], seen  # the last by regrade
    assert {r["evaluator"] for r in seen["replays"]} == {"test_on_output", "command"}
    assert all(r["session_id"].startswith("replay-") for r in seen["replays"])
    assert all(r["diverged"] is None for r in seen["replays"])  # none has, yet
    by_evaluator = {g["evaluator"]: g for g in seen["regrades"]}
    assert by_evaluator[MENTIONS]["reward"] == 0.25 and by_evaluator[MENTIONS]["via"] == "artifacts"
    assert by_evaluator["command"]["via"] == "replay" and by_evaluator["command"]["replay_session"]


@pytest.fixture(scope="module")
def bundle_file(tmp_path_factory):
    return tmp_path_factory.mktemp("bundle") / "calc.polar"


def test_a_bundle_holds_what_a_replay_needs(stack, recorded, bundle_file):
    session_id, agent = recorded
    r = polar(stack, "bundle", session_id, "-o", str(bundle_file))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 session(s), 2 record(s), 2 prepared file(s)" in r.stdout
    root, manifest = unpack(bundle_file, bundle_file.parent / "x")
    [b] = manifest.sessions
    assert b.session.session_id == session_id and b.session.token == "[redacted]"
    assert b.records == 2 and b.trajectory and b.artifacts and b.harness == "shell"
    assert sorted(b.sources.values()) == sorted([str(REPO / "infra/demo/calculator"), str(agent)])
    assert {"polar", "python", "nats-server"} <= set(manifest.versions)
    assert (root / "files/1").read_text() == agent.read_text()
    redacted = bundle_file.with_suffix(".redacted")
    r = polar(stack, "bundle", "replay-calc", "-o", str(redacted), "--redact")
    assert r.returncode == 0 and "(redacted)" in r.stdout, r.stdout + r.stderr
    assert unpack(redacted, bundle_file.parent / "y")[1].redacted
    r = polar(stack, "bundle", "no-such-session", "-o", str(redacted))
    assert r.returncode == 1 and "no session or task no-such-session" in r.stderr


def test_an_edited_harness_is_reported_at_the_call_and_field(stack, recorded):
    session_id, agent = recorded
    agent.write_text(AGENT.replace(SYSTEM, "You are a hasty agent. Use the bash tool."))
    r = polar(stack, "replay", "replay-calc")  # the task: each of its sessions, here one
    assert f"replaying {session_id} (attempt 0)" in r.stdout
    assert r.returncode == 4, r.stdout + r.stderr
    report = " ".join(r.stdout.split())
    assert f"diverged: replay of {session_id} diverged at call 0:" in report
    assert "messages[0].content: recorded 'You are a careful" in report
    assert "careful" in report and "hasty" in report
    operator = Stack.load(stack[1], None)
    headers = {"Authorization": f"Bearer {_dashboard_key(operator)}"}
    url = f"{operator.service_url('dashboard')}/api/sessions/{session_id}"
    [diverged] = [
        r for r in httpx.get(url, headers=headers, timeout=10).json()["lineage"]["replays"]
        if r["diverged"]
    ]  # fmt: skip
    assert "diverged at call 0" in diverged["diverged"]
    assert "messages[0].content: recorded 'You are a careful" in diverged["diverged"]


def test_a_bundle_replays_on_a_second_stack(recorded, bundle_file, tmp_path):
    """Another NATS, another Valkey, no engine; the agent file edited here since the
    bundle was written (above): the bundle's copy is what runs."""
    session_id, _ = recorded
    state_dir = tmp_path / "state"
    topology = tmp_path / "topology.yaml"
    text = demo_topology(state_dir, CALCULATOR / "policy.yaml", max_run=1)
    topology.write_text(text)
    topo = parse_topology(text, "second stack")
    devstack.up(topo, log=lambda _m: None)
    try:
        [model] = [p for p in read_state(state_dir).procs if p.name == "model"]
        localservers.stop_process(model.pid)
        r = run_polar(
            "replay", "--bundle", str(bundle_file), "--topology", str(topology), timeout=240
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert "bundle calc.polar: 1 session(s), recorded by" in r.stdout
        assert f"replaying {session_id} (attempt 0)" in r.stdout
        assert "replayed 2 call(s) from the record" in r.stdout
        assert "outcome COMPLETED (recorded COMPLETED), reward 1.0 (recorded 1.0)" in r.stdout
    finally:
        devstack.down(state_dir)
    bad = tmp_path / "not-a-bundle"
    bad.write_bytes(b"hello")
    r = run_polar("replay", "--bundle", str(bad), "--topology", str(topology), timeout=60)
    assert r.returncode != 0 and "not a polar bundle" in r.stdout + r.stderr
