"""``polar replay`` of real CLIs (issue 35): Codex (OpenAI Responses), Claude Code
(Anthropic Messages) and Gemini CLI (Gemini), each run once through the whole stack on
the scripted engine (tests/integration/harness_stack.py), then the engine stopped and
each session replayed by the ``polar`` CLI: every call answered from the record, the same
tool call run, the same file written, the same reward.

What differs between a CLI's run and its replay (its working directory is named after
its session, Claude Code's prompt carries the date) must read as nondeterminism, never
as a divergence. Slow (three CLIs, twice): ``just test-harness`` runs it, or
``POLAR_REPLAY_CLIS=1`` with ``just test``.
"""

from __future__ import annotations

import os

import pytest

from infra import localservers
from infra.stackstate import read_state
from tests.helpers.polar_cli import run_polar
from tests.integration.harness_stack import (
    Stack,
    cache_dir,
    harness_marks,
    harness_task,
    preinstall,
)

RUN = os.environ.get("POLAR_REPLAY_CLIS") == "1" or os.environ.get("POLAR_HARNESS_MATRIX") == "full"
pytestmark = [
    *harness_marks(),
    pytest.mark.skipif(not RUN, reason="slow: `just test-harness` (or POLAR_REPLAY_CLIS=1)"),
]
CLIS = {"codex": "codex", "claude-stream": "claude_code", "gemini": "gemini_cli"}


@pytest.fixture(scope="module")
async def recorded(tmp_path_factory):
    await preinstall(cache_dir())
    root = tmp_path_factory.mktemp("replay-clis")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POLAR_HARNESS_CACHE", str(cache_dir()))
        stack = Stack.up(root)
    try:
        runs = await stack.run([harness_task(tid, h) for tid, h in CLIS.items()])
        yield stack, runs
    finally:
        stack.down()


def test_each_cli_replays_without_the_engine_to_the_same_reward(recorded):
    stack, runs = recorded
    for tid, run in runs.items():
        assert run.session.state == "COMPLETED" and run.session.reward == 1.0, (tid, run.result)
    state = read_state(stack.topo.state_dir)
    [model] = [p for p in state.procs if p.name == "model"]
    localservers.stop_process(model.pid)  # no engine from here on
    topology = stack.root / "replay-topology.yaml"
    topology.write_text(stack.topology_text)
    for tid, run in runs.items():
        r = run_polar(
            "replay", run.session.session_id, "--topology", str(topology), timeout=600, columns=400
        )
        assert r.returncode == 0, (tid, r.stdout, r.stderr)
        made = sum(1 for rec in run.records if not rec.void)
        assert f"replayed {made} call(s) from the record" in r.stdout, (tid, r.stdout)
        assert "diverged" not in r.stdout
        assert "reward 1.0 (recorded 1.0)" in r.stdout, (tid, r.stdout)
