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
from pathlib import Path

import orjson
import pytest

from examples.runner import run_tasks
from infra import devstack, localservers
from infra.stackstate import read_state
from infra.topology import parse_topology
from schemas import CompletionRecord, Outcome
from services.builder.strategies.prefix_merging import PrefixMerging
from services.cli.demo import demo_topology
from services.common.bus import Bus
from services.common.completions import read_completions
from tests.helpers.polar_cli import run_polar
from tests.helpers.requires import requires_bwrap

pytestmark = [requires_bwrap, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
CALCULATOR = REPO / "examples" / "calculator"
AGENT = (REPO / "infra" / "demo" / "agent.py").read_text()
SYSTEM = "You are a careful coding agent. Use the bash tool."


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
