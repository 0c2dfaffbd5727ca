"""The evaluator service's decisions: what to do with a built session, reward rules,
the scored trajectory, the final transition."""

import pytest

from evaluators import EvalResult
from schemas import Outcome, Session, SessionState, Trace, Trajectory, TrajectoryBuilt
from services.evaluator import logic
from services.evaluator.logic import Action

S = SessionState


def session(state: SessionState, attempt: int = 0) -> Session:
    return Session(
        session_id="t-0001", task_id="t", index=1, token="x", state=state, attempt=attempt
    )


def built(attempt: int = 0, outcome: Outcome = Outcome.COMPLETED) -> TrajectoryBuilt:
    return TrajectoryBuilt(session_id="t-0001", task_id="t", outcome=outcome, attempt=attempt)


def trajectory(outcome=Outcome.COMPLETED, intact=True, policy="evaluate") -> Trajectory:
    trace = Trace(
        trace_id="c0",
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        loss_mask=[1, 1] if policy != "masked" else [0, 0],
        response_logprobs=[-0.1, -0.2],
        reward=0.0 if outcome != Outcome.COMPLETED else None,
    )
    return Trajectory(
        session_id="t-0001",
        task_id="t",
        outcome=outcome,
        builder="prefix_merging",
        traces=[trace, trace],
        intact=intact,
        metadata={"reward_policy": policy},
    )


@pytest.mark.parametrize(
    ("state", "attempt", "action"),
    [
        (S.EVALUATING, 0, Action.EVALUATE),
        (S.BUILDING, 0, Action.ADVANCE),  # built: the builder's move may lag
        (S.COMPLETED, 0, Action.FINALIZE),
        (S.CANCELLED, 0, Action.FINALIZE),
        (S.EVALUATING, 1, Action.SKIP),  # another attempt's trajectory
        (S.RUNNING, 0, Action.SKIP),
    ],
)
def test_decide(state, attempt, action):
    assert logic.decide(session(state, attempt), built()).action is action


def test_decide_without_session_is_poison():
    d = logic.decide(None, built())
    assert d.action is Action.POISON and "no session 't-0001'" in d.reason


def test_plan_by_outcome():
    assert logic.plan(trajectory()).evaluate
    p = logic.plan(trajectory(Outcome.TIMEOUT, policy="zero_reward"))
    assert not p.evaluate
    assert (p.result.status, p.result.reward) == ("ok", 0.0)
    assert p.result.reason == "session ended timeout: reward 0 by rule"
    p = logic.plan(trajectory(Outcome.ERROR, intact=False, policy="masked"))
    assert p.result.reward == 0.0 and p.result.details["masked"] is True
    assert p.result.reason.endswith("trajectory not intact: fully masked")


def test_runtime_kind():
    assert logic.runtime_kind("none", "live") is None
    assert logic.runtime_kind("task", "live") == "live"
    assert logic.runtime_kind("task", "fresh") == "fresh"
    assert logic.runtime_kind("fresh", "live") == "fresh"


def test_score_puts_the_reward_everywhere_and_keeps_masks():
    t = trajectory(Outcome.ERROR, intact=False, policy="masked")
    s = logic.score(t, EvalResult.ok(0.0, "rule", masked=True), num_samples=4, index=1)
    assert s.reward == 0.0 and [tr.reward for tr in s.traces] == [0.0, 0.0]
    assert [tr.loss_mask for tr in s.traces] == [[0, 0], [0, 0]]
    assert (s.eval_status, s.eval_reason) == ("ok", "rule")
    assert s.metadata == {
        "reward_policy": "masked",
        "num_samples": 4,
        "sample_index": 1,
        "eval_details": {"masked": True},
    }


def test_score_of_an_error_has_no_reward():
    s = logic.score(trajectory(), EvalResult.error("boom"), num_samples=2, index=0)
    assert s.reward is None and all(tr.reward is None for tr in s.traces)
    assert (s.eval_status, s.eval_reason) == ("error", "boom")


def test_final_fields_and_scored_event():
    assert logic.final_fields(EvalResult.ok(0.0, "0/1 tests as expected")) == {
        "eval_status": "ok",
        "eval_reason": "0/1 tests as expected",
        "reward": 0.0,
    }
    assert logic.final_fields(EvalResult.error("x timed out")) == {
        "eval_status": "error",
        "eval_reason": "x timed out",
        "reason": "evaluator error: x timed out",
    }
    ev = logic.scored_event(built(), EvalResult.error("boom"), 5.0)
    assert (ev.reward, ev.eval_status, ev.reason, ev.ts) == (None, "error", "boom", 5.0)
    assert logic.trajectory_msg_id("t-0001", 2) == "traj:t-0001:2"


def test_results_survive_a_round_trip_through_redis_bytes():
    r = EvalResult.ok(0.25, "partial", tests={"a": "PASSED"}, odd=object())
    back = logic.decode_result(logic.encode_result(r))
    assert (back.status, back.reward, back.reason) == ("ok", 0.25, "partial")
    assert back.details["tests"] == {"a": "PASSED"} and isinstance(back.details["odd"], str)
    assert logic.encode_result(back) == logic.encode_result(
        logic.decode_result(logic.encode_result(back))
    )
