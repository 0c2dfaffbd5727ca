"""``rubric``: an LLM judge over real HTTP (a loopback OpenAI-compatible server): the
score per trace, mixed into a base evaluator's reward with the coefficient, the judge's
calls recorded as the session's side calls (answered or failed); a judge that times out,
errors or answers garbage, or a call that cannot be recorded, is an explicit evaluator
error, never a 0."""

import asyncio

import msgspec
import orjson
import pytest

from evaluators.base import EvalContext, EvaluatorError
from evaluators.registry import create_evaluator, default_registry, run_evaluator
from evaluators.rubric import Rubric, parse_score
from schemas import Artifacts, CompletionRecord, Outcome, TaskRequest, Trace, Trajectory
from services.evaluator import logic
from tests.helpers.http_sink import JsonServer

RUBRIC = "Full marks when the agent fixed add() and ran the tests."


def trace(answer: str, side_call: str | None = None, i: int = 0) -> Trace:
    return Trace(
        trace_id=f"s/{i}",
        prompt_ids=[1],
        response_ids=[2, 3],
        loss_mask=[1, 1],
        response_logprobs=[-0.1, -0.2],
        messages=[
            {"role": "user", "content": "Fix calc.py"},
            {"role": "assistant", "content": answer},
        ],
        side_call=side_call,
    )


class KeptSideCalls:
    """``SideCalls`` in memory: numbers after ``numbered`` harness calls, keeps records;
    ``broken`` commits nothing (a bus that refuses), giving the number back."""

    def __init__(self, numbered: int = 0, broken: bool = False) -> None:
        self.next, self.broken = numbered, broken
        self.records: list[CompletionRecord] = []

    async def number(self) -> int:
        self.next += 1
        return self.next - 1

    async def commit(self, record: CompletionRecord) -> None:
        if self.broken:
            self.next -= 1
            raise EvaluatorError("the side call's record was not committed: bus down")
        self.records.append(record)


def context(traces, url: str, side_calls=None, **config) -> EvalContext:
    traj = Trajectory(
        session_id="s", task_id="t", attempt=1, outcome=Outcome.COMPLETED, builder="x",
        traces=traces,
    )  # fmt: skip
    task = TaskRequest(instruction="Fix calc.py", task_id="t")
    cfg = {"url": url, "model": "judge", "rubric": RUBRIC, **config}
    return EvalContext(traj, Artifacts(), task, cfg, side_calls=side_calls)


def conversation(rec: CompletionRecord) -> tuple[dict, dict | None]:
    return msgspec.json.decode(rec.normalized), msgspec.json.decode(rec.reply)


def judge_answering(reply_for):
    """A judge that answers ``reply_for(transcript text)`` as a chat completion."""

    def route(doc):
        user = doc["messages"][-1]["content"]
        return 200, {"choices": [{"message": {"role": "assistant", "content": reply_for(user)}}]}

    return JsonServer({("POST", "/v1/chat/completions"): route})


def run(ctx: EvalContext, timeout: float = 10.0):
    return asyncio.run(run_evaluator(Rubric(), ctx, timeout, "rubric"))


def score_by_answer(user: str) -> str:
    return "Looks right.\nSCORE: 8" if "I fixed add()" in user else "SCORE: 2"


def test_score_per_trace_mixed_into_the_base_reward():
    async def go():
        async with judge_answering(score_by_answer) as judge:
            ctx = context(
                [trace("I fixed add()", i=0), trace("gave up", i=1)],
                judge.url + "/v1",
                scale=[0, 10],
                coefficient=0.5,
                base={"name": "session_completed"},
            )
            result = await run_evaluator(Rubric(), ctx, 10.0, "rubric")
            return result, judge.requests

    result, requests = asyncio.run(go())
    assert result.status == "ok", result.reason
    # session_completed gives 1.0; the scores 8 and 2 on [0, 10] are 0.8 and 0.2
    assert result.trace_rewards == pytest.approx((1.4, 1.1))
    assert result.reward == pytest.approx(1.0 + 0.5 * 0.5)
    assert result.details["judge_scores"] == [8.0, 2.0]
    assert [c["side_call"] for c in result.details["judge_calls"]] == ["judge", "judge"]
    assert result.details["base_reward"] == 1.0
    # what the judge saw: the rubric, the task and the trace's transcript
    prompt = requests[0][2]["messages"][-1]["content"]
    assert RUBRIC in prompt and "I fixed add()" in prompt
    assert requests[0][2]["model"] == "judge"


def test_side_call_traces_are_not_judged():
    async def go():
        async with judge_answering(score_by_answer) as judge:
            url = judge.url + "/v1"
            ctx = context([trace("I fixed add()"), trace("A title", side_call="title")], url)
            return await run_evaluator(Rubric(), ctx, 10.0, "rubric"), judge.requests

    result, requests = asyncio.run(go())
    assert result.status == "ok"
    assert len(requests) == 1  # the title call was not sent to the judge
    assert result.reward == pytest.approx(0.8)
    assert result.trace_rewards == pytest.approx((0.8, 0.8))


def test_garbage_reply_is_an_evaluator_error_not_zero():
    async def go():
        async with judge_answering(lambda _user: "I would rather not say.") as judge:
            ctx = context([trace("I fixed add()")], judge.url + "/v1")
            return await run_evaluator(Rubric(), ctx, 10.0, "rubric")

    result = asyncio.run(go())
    assert result.status == "error" and result.reward is None
    assert "trace 0 (s/0): the judge's reply holds no score" in result.reason


def test_score_outside_the_scale_is_an_error():
    async def go():
        async with judge_answering(lambda _user: "SCORE: 42") as judge:
            ctx = context([trace("x")], judge.url + "/v1", scale=[1, 5])
            return await run_evaluator(Rubric(), ctx, 10.0, "rubric")

    result = asyncio.run(go())
    assert result.status == "error"
    assert "score 42 is outside the scale [1, 5]" in result.reason


def test_non_completion_and_http_errors_are_errors():
    async def go():
        routes = {
            ("POST", "/a/v1/chat/completions"): lambda _doc: (200, {"nothing": True}),
            ("POST", "/b/v1/chat/completions"): lambda _doc: (500, {"error": "overloaded"}),
        }
        async with JsonServer(routes) as judge:
            base = judge.url
            a = await run_evaluator(Rubric(), context([trace("x")], base + "/a/v1"), 10, "rubric")
            b = await run_evaluator(Rubric(), context([trace("x")], base + "/b/v1"), 10, "rubric")
            return a, b

    a, b = asyncio.run(go())
    assert a.status == "error" and "is not a chat completion" in a.reason
    assert b.status == "error" and "the judge answered HTTP 500" in b.reason


class SilentJudge:
    """Accepts the connection and the request, never answers."""

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def _handle(self, reader, writer):
        await reader.read(65536)
        await asyncio.sleep(30)
        writer.close()

    async def __aexit__(self, *exc):
        self.server.close()


def test_judge_timeout_is_an_evaluator_error():
    async def go():
        async with SilentJudge() as judge:
            ctx = context([trace("x")], judge.url, timeout_seconds=0.5)
            return await run_evaluator(Rubric(), ctx, 10.0, "rubric")

    result = asyncio.run(go())
    assert result.status == "error" and result.reward is None
    assert "the judge did not answer within 0.5s" in result.reason


def test_unreachable_judge_and_bad_config_are_errors():
    from infra.localservers import free_port

    unreachable = run(context([trace("x")], f"http://127.0.0.1:{free_port()}/v1"))
    assert unreachable.status == "error" and "is unreachable" in unreachable.reason
    bad_scale = run(context([trace("x")], "http://127.0.0.1:1/v1", scale=[5, 1]))
    assert "`scale` must be [low, high]" in bad_scale.reason
    no_url = run(context([trace("x")], ""))
    assert "rubric config lacks url" in no_url.reason
    no_key = run(context([trace("x")], "http://127.0.0.1:1/v1", api_key_env="POLAR_NO_SUCH_KEY"))
    assert "$POLAR_NO_SUCH_KEY (api_key_env) is not set" in no_key.reason


def test_failing_base_evaluator_is_an_error():
    ctx = context([trace("x")], "http://127.0.0.1:1/v1", base={"name": "no_such_evaluator"})
    result = run(ctx)
    assert result.status == "error" and "no_such_evaluator" in result.reason


def test_parse_score_forms():
    assert parse_score('{"score": 3}', 0, 10) == 3.0
    assert parse_score("score 1 at first... Final SCORE: 9.5", 0, 10) == 9.5
    with pytest.raises(Exception, match="holds no score"):
        parse_score("nine", 0, 10)


def test_registered_and_scored_trajectory_keeps_trace_rewards():
    assert isinstance(create_evaluator(default_registry(), "rubric"), Rubric)

    async def go():
        async with judge_answering(score_by_answer) as judge:
            url = judge.url + "/v1"
            ctx = context([trace("I fixed add()", i=0), trace("gave up", i=1)], url)
            return ctx, await run_evaluator(Rubric(), ctx, 10.0, "rubric")

    ctx, result = asyncio.run(go())
    scored = logic.score(ctx.trajectory, result, num_samples=1, index=0)
    assert [t.reward for t in scored.traces] == pytest.approx([0.8, 0.2])
    # the judge calls survive the kept result (the evaluator service stores it)
    back = logic.decode_result(logic.encode_result(result))
    assert orjson.loads(orjson.dumps(back.details["judge_calls"]))[0]["side_call"] == "judge"


def test_judge_calls_are_the_sessions_side_call_records():
    kept = KeptSideCalls(numbered=3)  # the harness made calls 0, 1, 2

    async def go():
        async with judge_answering(score_by_answer) as judge:
            traces = [trace("I fixed add()", i=0), trace("t", "title", i=1), trace("no", i=2)]
            ctx = context(traces, judge.url + "/v1", side_calls=kept)
            return await run_evaluator(Rubric(), ctx, 10.0, "rubric")

    result = asyncio.run(go())
    assert result.status == "ok", result.reason
    # one record per judged trace, numbered after the harness's calls, tagged, of the
    # judged session's attempt; each result entry names its record
    assert [r.seq for r in kept.records] == [3, 4]
    assert [c["seq"] for c in result.details["judge_calls"]] == [3, 4]
    assert {(r.session_id, r.attempt, r.side_call, r.model) for r in kept.records} == {
        ("s", 1, "judge", "judge")
    }
    conv, reply = conversation(kept.records[0])
    assert RUBRIC in conv["messages"][-1]["content"] and "I fixed add()" in str(conv)
    assert reply == {"role": "assistant", "content": "Looks right.\nSCORE: 8"}
    assert msgspec.json.decode(kept.records[0].raw_request)["model"] == "judge"
    # nothing sampled by the judge is in any record as tokens: nothing to train on
    assert all(not r.output_ids and not r.prompt_ids and not r.void for r in kept.records)


def test_failed_and_garbage_judge_calls_are_recorded_and_still_errors():
    async def go():
        routes = {
            ("POST", "/bad/v1/chat/completions"): lambda _doc: (500, {"error": "overloaded"}),
            ("POST", "/junk/v1/chat/completions"): lambda _doc: (
                200, {"choices": [{"message": {"content": "no idea"}}]}
            ),
        }  # fmt: skip
        kept = KeptSideCalls()
        async with JsonServer(routes) as judge:
            bad = context([trace("x")], judge.url + "/bad/v1", side_calls=kept)
            junk = context([trace("x")], judge.url + "/junk/v1", side_calls=kept)
            a = await run_evaluator(Rubric(), bad, 10.0, "rubric")
            b = await run_evaluator(Rubric(), junk, 10.0, "rubric")
        return a, b, kept.records

    failed, garbage, (failed_rec, garbage_rec) = asyncio.run(go())
    assert failed.status == "error" and "the judge answered HTTP 500" in failed.reason
    assert failed_rec.void and "HTTP 500" in failed_rec.error  # a call with nothing sampled
    assert failed_rec.finish_reason == "error" and failed_rec.side_call == "judge"
    assert garbage.status == "error" and "holds no score" in garbage.reason
    assert garbage_rec.error is None and conversation(garbage_rec)[1]["content"] == "no idea"


def test_a_judge_call_that_cannot_be_recorded_is_an_error():
    broken = KeptSideCalls(numbered=2, broken=True)

    async def go():
        async with judge_answering(score_by_answer) as judge:
            ctx = context([trace("I fixed add()")], judge.url + "/v1", side_calls=broken)
            ok = await run_evaluator(Rubric(), ctx, 10.0, "rubric")
            dead = context([trace("x")], "http://127.0.0.1:1/v1", side_calls=broken)
            return ok, await run_evaluator(Rubric(), dead, 10.0, "rubric")

    answered, unreachable = asyncio.run(go())
    assert answered.status == "error" and answered.reward is None
    assert "trace 0 (s/0): the side call's record was not committed" in answered.reason
    # the judge's own failure stays the first thing said, the lost record after it
    assert unreachable.status == "error" and "is unreachable" in unreachable.reason
    assert "record was not committed" in unreachable.reason
    assert broken.next == 2  # every number given back
