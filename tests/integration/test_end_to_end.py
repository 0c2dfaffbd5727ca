"""The whole system, as separate processes: scheduler -> pool -> executor -> proxy ->
embedded model -> builder -> evaluator -> a subscribed trainer client, plus the TaskResult
on its subject and at the callback URL."""

import asyncio
import tempfile
from pathlib import Path

import orjson
import pytest

from infra import devstack
from infra.topology import parse_topology
from schemas import TaskResult, decode
from schemas import subjects as S
from services.cli.demo import demo_task, demo_topology
from services.client import TrajectoryClient
from services.common.bus import Bus
from tests.helpers.http_sink import HttpSink

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def stack():
    state_dir = Path(tempfile.mkdtemp(prefix="polar-e2e-"))
    topo = parse_topology(demo_topology(state_dir), "e2e topology")
    devstack.up(topo)
    yield devstack.operator_view(topo)  # signed in to the stack's NATS as the operator
    report = devstack.down(state_dir)
    assert not report.still_listening


async def test_four_samples_delivered_scored_with_result_and_callback(stack):
    bus = await Bus.open(stack.nats_url, "e2e")
    results = await bus.nc.subscribe(S.task_result("e2e-calc"))
    async with HttpSink() as sink:
        task = {**demo_task("e2e-calc"), "callback_url": sink.url}
        async with TrajectoryClient(
            stack.nats_url, durable="e2e-trainer", task_ids=["e2e-calc"]
        ) as client:
            await bus.js.publish(S.TASKS_SUBMIT, orjson.dumps(task))

            async def one_group():
                async for group in client.groups():
                    await group.commit()
                    return group

            group = await asyncio.wait_for(one_group(), 300)
        result = decode(await bus.payload(await results.next_msg(timeout=60)), TaskResult)
        await asyncio.wait_for(sink.received.wait(), 60)
    await bus.close()

    assert group.complete and len(group.trajectories) == 4
    assert {t.session_id for t in group.trajectories} == {f"e2e-calc-{i:04d}" for i in range(4)}
    for t in group.trajectories:
        assert t.reward == 1.0 and t.eval_status == "ok" and t.intact
        assert t.builder == "prefix_merging" and t.harness == "shell"
        (main,) = [tr for tr in t.traces if not tr.side_call]  # one merged chain
        assert sum(main.loss_mask) == t.stats.sampled_tokens > 0
        sampled = [lp for lp, m in zip(main.response_logprobs, main.loss_mask, strict=True) if m]
        assert all(lp is not None and lp <= 0 for lp in sampled)
        assert all(
            lp is None
            for lp, m in zip(main.response_logprobs, main.loss_mask, strict=True)
            if not m
        )
        assert t.stats.completions == 5 and t.stats.merge_ratio > 1
    assert result.status == "completed" and result.mean_reward == 1.0
    assert [s.reward for s in result.sessions] == [1.0] * 4
    assert decode(sink.bodies[0], TaskResult) == result
