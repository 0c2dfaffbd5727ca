"""A cancelled session still yields its trajectory, once, and its group completes.

Real NATS and Valkey of the test's own, a real node (pool + executor, local runtime), the
real scheduler's cancel, and the real builder and evaluator run in drain mode; the
trainer's ``TrajectoryClient.groups()`` reads what they delivered.
"""

from __future__ import annotations

import pytest

from schemas import Outcome, SessionState
from schemas import subjects as S
from services.client import TrajectoryClient
from services.scheduler import logic
from tests.helpers.delivery import deliver
from tests.helpers.node import Node, task, wait_until

pytestmark = pytest.mark.asyncio
ST = SessionState


async def test_cancelled_sessions_yield_their_trajectories_and_the_group_completes(
    fresh_servers, tmp_path
):
    nats_url, _ = fresh_servers
    node = await Node.start(
        *fresh_servers, tmp_path / "work", max_init=1, ready_buffer=1, max_run=1
    )
    try:
        spec = task("cx-traj", 3, agent={"command": "sleep 200"})
        sids = [s.session_id for s in await node.scheduler.accept(logic.with_task_id(spec))]

        async def one_running_one_ready() -> bool:
            states = [(await node.registry.get_session(sid)).state for sid in sids]
            return ST.RUNNING in states and ST.READY in states

        await wait_until(one_running_one_ready, 60, "one RUNNING, one READY")
        before = {sid: (await node.registry.get_session(sid)).state for sid in sids}
        assert await node.scheduler.cancel_task("cx-traj", "test cancel") == 3
        await wait_until(lambda: not node.executor.running, 10, "the run to stop")
        # each one finished once, as CANCELLED (the RUNNING one's executor finishes nothing)
        await node.wait_finished(3, timeout=10)
        assert {e.outcome for e in node.finished.values()} == {Outcome.CANCELLED}
        await deliver(node.bus, node.registry, tmp_path / "eval")

        after = [await node.registry.get_session(sid) for sid in sids]
        assert [s.state for s in after] == [ST.CANCELLED] * 3, before
        assert {s.reward for s in after} == {0.0}
        info = await node.bus.js.stream_info(S.STREAM_TRAJECTORIES)
        assert info.state.messages == 3  # exactly once each

        async with TrajectoryClient(nats_url, durable="cx-traj", task_ids=["cx-traj"]) as client:
            groups = [g async for g in client.groups(stop_when_idle=True)]
            assert len(groups) == 1 and groups[0].complete
            got = groups[0].trajectories
            assert sorted(t.session_id for t in got) == sorted(sids)
            assert {(t.outcome, t.reward) for t in got} == {(Outcome.CANCELLED, 0.0)}
            await groups[0].commit()
        await node.scheduler.maybe_finish("cx-traj")
        assert (await node.registry.get_task("cx-traj")).status == "cancelled"
    finally:
        await node.stop()
