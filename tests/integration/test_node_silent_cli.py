"""An agent CLI that exits 0 without one model call did nothing: its session ends in
ERROR with that reason, not COMPLETED with an empty trajectory. A shell harness (any
command, no model needed) is not judged that way. The CLI presets that do call the
model end COMPLETED in tests/integration/test_harness_presets.py."""

from __future__ import annotations

import pytest

from schemas import Outcome
from services.node.harnesses.shell import ShellHarness
from services.scheduler import logic
from tests.helpers.node import Node, task

pytestmark = pytest.mark.asyncio


class SilentAgent(ShellHarness):
    """A stand-in for an agent CLI (``calls_model``) that never reaches the model."""

    name = "silent_agent"
    calls_model = True


async def test_an_agent_that_exits_0_without_calling_the_model_is_an_error(fresh_servers, tmp_path):
    nats_url, redis_url = fresh_servers
    node = await Node.start(nats_url, redis_url, tmp_path / "work")
    try:
        runtime = {"backend": "local"}
        silent = task(
            "silent",
            runtime=runtime,
            agent={"harness": f"{__name__}:SilentAgent", "command": "echo done"},
        )
        shell = task("plain", runtime=runtime, agent={"harness": "shell", "command": "echo done"})
        [a] = await node.scheduler.accept(logic.with_task_id(silent))
        [b] = await node.scheduler.accept(logic.with_task_id(shell))
        await node.wait_finished(2, timeout=30)
        ev = node.finished[a.session_id]
        assert ev.outcome == Outcome.ERROR, ev.reason
        assert ev.reason == "silent_agent exited 0 without calling the model"
        assert ev.artifacts.exit_code == 0 and "done" in ev.artifacts.stdout_tail
        assert node.finished[b.session_id].outcome == Outcome.COMPLETED
    finally:
        await node.stop()
