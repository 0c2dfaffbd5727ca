"""``rubric``'s judge calls captured as the judged session's side calls, through the real
builder and evaluator services on NATS JetStream and Valkey: the harness's records are
built, the judge (a loopback OpenAI-compatible server) scores the trace, its call is a
record of the session numbered after the harness's calls and tagged ``judge``; the
delivered trajectory holds none of it, a rebuild from every record trains on none of
it, and a redelivery neither judges nor delivers again."""

from __future__ import annotations

import random

import msgspec
import pytest

from proxy.callcount import number_call, numbered_calls, release_call
from schemas import (
    BuilderSpec,
    EvaluatorSpec,
    Outcome,
    SessionFinished,
    SessionState,
    TaskRequest,
    TrajectoryBuilt,
    encode,
)
from schemas import subjects as S
from services.builder import logic as build_logic
from services.builder.config import BuilderConfig
from services.builder.handlers import Builder
from services.builder.main import consumers as builder_consumers
from services.builder.strategies import default_registry as builders
from services.common.completions import read_completions
from services.common.registry import Registry
from services.evaluator.config import EvaluatorConfig
from services.evaluator.handlers import EvaluatorService
from services.evaluator.main import consumers as evaluator_consumers
from services.trainer.batch import trainable_traces
from tests.helpers.http_sink import JsonServer
from tests.unit.builder.synth import Capture, agent_loop
from tests.unit.evaluators.sessions import delivered, new_sessions, remove_built

pytestmark = pytest.mark.asyncio
DONE = Outcome.COMPLETED
TO_POSTRUN = ("INITIALIZING", "READY", "RUNNING", "POSTRUN")


@pytest.fixture(autouse=True)
async def _clean_work_queue(bus):
    yield
    await remove_built(bus, "rubcap-")


async def drain(*services) -> None:
    for service, consumers in services:
        for c in consumers(service):
            await c.run(drain=True)


def judge() -> JsonServer:
    def route(doc):
        verdict = "SCORE: 6" if "[garbage]" not in str(doc) else "no verdict today"
        return 200, {"model": "judge-7b", "choices": [{"message": {"content": verdict}}]}

    return JsonServer({("POST", "/v1/chat/completions"): route})


async def run_harness(bus, redis, session_id: str, turns: int) -> None:
    """Records as the proxy leaves them: numbered by its counter, one per call."""
    cap = Capture(session_id)
    agent_loop(cap, random.Random(7), turns)
    for rec in cap.records:
        await redis.incr(S.key_call_seq(session_id))
        sid = rec.session_id
        await bus.publish(S.completions(sid), encode(rec), msg_id=S.completion_msg_id(sid, rec.seq))


async def test_judge_calls_are_captured_side_calls_never_trained(bus, redis_client, state_dir):
    registry = Registry(redis_client)
    builder = Builder(bus, registry, BuilderConfig(retry_delay_seconds=0.1, settle_seconds=2))
    evaluator = EvaluatorService(
        bus, registry, EvaluatorConfig(work_dir=str(state_dir / "rubcap"), retry_delay_seconds=0.1)
    )
    async with judge() as server:
        config = {"url": server.url + "/v1", "model": "judge", "rubric": "fix it", "scale": [0, 10]}
        specs = {
            "rubcap-ok": EvaluatorSpec(name="rubric", runtime="fresh", config=config),
            "rubcap-garbage": EvaluatorSpec(
                name="rubric", runtime="fresh", config={**config, "rubric": "[garbage]"}
            ),
        }
        sids = {}
        for task_id, spec in specs.items():
            task = TaskRequest(
                task_id=task_id, instruction="x", evaluator=spec, builder=BuilderSpec()
            )
            (sids[task_id],) = await new_sessions(registry, task, to=TO_POSTRUN)
            await run_harness(bus, redis_client, sids[task_id], turns=3)
            await bus.publish(
                S.SESSIONS_FINISHED,
                encode(SessionFinished(session_id=sids[task_id], task_id=task_id, outcome=DONE)),
            )
        await drain((builder, builder_consumers), (evaluator, evaluator_consumers))

        sid = sids["rubcap-ok"]
        (traj,) = await delivered(bus, "rubcap-ok")
        assert traj.eval_status == "ok" and traj.reward == pytest.approx(0.6)
        records, problems = await read_completions(bus, sid)
        assert not problems
        by_seq = {r.seq: r for r in records}
        # the judge's call: the session's 4th record, numbered by the proxy's counter
        assert sorted(by_seq) == [0, 1, 2, 3] and await numbered_calls(redis_client, sid) == 4
        judged = by_seq[3]
        assert (judged.side_call, judged.served_model, judged.attempt) == ("judge", "judge-7b", 0)
        assert msgspec.json.decode(judged.reply)["content"] == "SCORE: 6"
        assert traj.metadata["eval_details"]["judge_calls"][0]["seq"] == 3
        # the delivered trajectory was built before the judge ran: the harness's calls only
        assert [s for t in traj.traces for s in t.completion_seqs] == [0, 1, 2]
        # a rebuild from every record (the dashboard's) has the judge as a side call with
        # no token to train on, and the trainer takes only what the delivered one had
        for name in ("prefix_merging", "per_request"):
            event = SessionFinished(session_id=sid, task_id="rubcap-ok", outcome=DONE)
            again = build_logic.build_trajectory(event, BuilderSpec(name), records, builders())
            (side,) = [t for t in again.traces if t.side_call == "judge"]
            assert side.completion_seqs == [3] and not side.trainable and not side.response_ids
            assert again.intact
            main = [t.trace_id for t in trainable_traces(again)]
            assert len(main) == (1 if name == "prefix_merging" else 3)

        # the garbage verdict: an evaluator error, its call recorded all the same
        gid = sids["rubcap-garbage"]
        (bad,) = await delivered(bus, "rubcap-garbage")
        assert bad.eval_status == "error" and bad.reward is None
        assert "the judge's reply holds no score" in bad.eval_reason
        records, _ = await read_completions(bus, gid)
        assert [r.side_call for r in sorted(records, key=lambda r: r.seq)][-1] == "judge"

        # a redelivered TrajectoryBuilt: the session is final, nothing judged or sent again
        requests = len(server.requests)
        again = TrajectoryBuilt(session_id=sid, task_id="rubcap-ok", outcome=DONE)
        await bus.publish(again.subject, encode(again), msg_id=f"again:{sid}")
        await drain((evaluator, evaluator_consumers))
        assert len(server.requests) == requests
        assert len(await delivered(bus, "rubcap-ok")) == 1
        assert len(await delivered(bus, "rubcap-garbage")) == 1
    states = {s.state for t in specs for s in await registry.task_sessions(t)}
    assert states == {SessionState.COMPLETED}


async def test_a_side_call_number_is_given_back_only_while_it_is_the_last(redis_client):
    sid = f"rubcap-seq-{random.randrange(10**9)}"
    await redis_client.set(S.key_call_seq(sid), 5)  # the harness made calls 0..4
    first = await number_call(redis_client, sid)
    assert first == 5 and await release_call(redis_client, sid, first)
    assert await numbered_calls(redis_client, sid) == 5  # no gap left
    a, b = await number_call(redis_client, sid), await number_call(redis_client, sid)
    assert not await release_call(redis_client, sid, a)  # b was taken after it
    assert (a, b, await numbered_calls(redis_client, sid)) == (5, 6, 7)
