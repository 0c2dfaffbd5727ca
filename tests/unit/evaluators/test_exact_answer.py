"""``exact_answer``: per-trace rewards against the config's answers, the session mean,
the reason; and the service keeps each trace's own reward on the scored trajectory."""

import asyncio

import pytest

from evaluators import EvalResult
from evaluators.base import EvalContext, checked
from evaluators.exact_answer import ExactAnswer, reported_answers
from evaluators.registry import create_evaluator, default_registry, run_evaluator
from schemas import Artifacts, Outcome, TaskRequest, Trace, Trajectory
from services.evaluator import logic

ANSWERS = {"How many * in **........?": "2", "How many * in *.........?": "1"}


def trace(question: str | None, answer: str | None = None, side_call: str | None = None):
    messages = [] if question is None else [{"role": "user", "content": question}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return Trace(
        trace_id="c0",
        prompt_ids=[1],
        response_ids=[2, 3],
        loss_mask=[1, 1],
        response_logprobs=[-0.1, -0.2],
        messages=messages,
        side_call=side_call,
    )


def context(traces, stdout="", answers=ANSWERS) -> EvalContext:
    traj = Trajectory(
        session_id="t-0",
        task_id="t",
        outcome=Outcome.COMPLETED,
        builder="per_request",
        traces=traces,
    )
    task = TaskRequest(instruction="\n".join(answers), task_id="t")
    return EvalContext(traj, Artifacts(stdout_tail=stdout), task, {"answers": answers})


def evaluate(ctx: EvalContext) -> EvalResult:
    return asyncio.run(run_evaluator(ExactAnswer(), ctx, 5.0, "exact_answer"))


def test_each_trace_scored_from_its_own_answer():
    q2, q1 = ANSWERS
    r = evaluate(context([trace(q2, "2"), trace(q1, " 3\n")]))
    assert r.status == "ok"
    assert r.trace_rewards == (1.0, 0.0)
    assert r.reward == 0.5
    assert r.reason == "1/2 answers correct (1 wrong)"


def test_answer_format_is_part_of_the_task():
    q2, q1 = ANSWERS
    r = evaluate(context([trace(q2, "2."), trace(q1, "one")]))
    assert r.trace_rewards == (0.0, 0.0)


def test_answers_from_the_agents_report_when_the_trace_has_no_reply():
    q2, q1 = ANSWERS
    out = f'noise\n{{"question": "{q1}", "answer": "1"}}\n{{"question": "{q2}", "answer": "7"}}\n'
    r = evaluate(context([trace(q2), trace(q1)], stdout=out))
    assert r.trace_rewards == (0.0, 1.0)
    assert r.details["correct"] == 1


def test_unasked_unknown_and_unanswered_questions_count_against():
    q2, _ = ANSWERS
    r = evaluate(context([trace(q2, "2"), trace("How many * in ....?", "0"), trace(None)]))
    assert r.trace_rewards == (1.0, 0.0, 0.0)
    # three traces + one question never asked: 1 / 4
    assert r.reward == 0.25
    assert r.reason == "1/3 answers correct (2 unknown_question, 1 questions not asked)"


def test_side_calls_get_zero_and_stay_out_of_the_mean():
    q2, q1 = ANSWERS
    r = evaluate(context([trace(q2, "2"), trace(q1, "1"), trace(q1, "1", side_call="title")]))
    assert r.trace_rewards == (1.0, 1.0, 0.0)
    assert r.reward == 1.0


def test_no_answer_when_neither_trace_nor_report_has_one():
    q2, q1 = ANSWERS
    r = evaluate(context([trace(q2), trace(q1, "1")]))
    assert r.reason == "1/2 answers correct (1 no_answer)"


@pytest.mark.parametrize("answers", [{}, None, ["2"]])
def test_bad_config_is_an_error_result(answers):
    ctx = context([trace("q", "2")])
    ctx.config = {"answers": answers}
    r = evaluate(ctx)
    assert r.status == "error"
    assert "config.answers must be a non-empty" in r.reason


def test_reported_answers_ignores_other_lines():
    assert reported_answers('x\n[1]\n{"question": "a", "answer": 3}\n{"q": 1}') == {"a": "3"}


def test_registered_by_name():
    ev = create_evaluator(default_registry(), "exact_answer")
    assert isinstance(ev, ExactAnswer) and ev.needs_runtime == "none"


def test_trace_rewards_must_match_the_traces():
    bad = EvalResult.per_trace(1.0, [1.0])
    assert checked(bad, "x", traces=2).status == "error"
    assert "gave 1 trace rewards for 2 traces" in checked(bad, "x", traces=2).reason
    nan = EvalResult.per_trace(1.0, [float("nan")])
    assert checked(nan, "x", traces=1).status == "error"


def test_scored_trajectory_keeps_each_traces_reward():
    q2, q1 = ANSWERS
    ctx = context([trace(q2, "2"), trace(q1, "9")])
    scored = logic.score(ctx.trajectory, evaluate(ctx), num_samples=4, index=0)
    assert [t.reward for t in scored.traces] == [1.0, 0.0]
    assert scored.reward == 0.5
    assert scored.eval_reason == "1/2 answers correct (1 wrong)"


def test_kept_result_round_trips_the_trace_rewards():
    r = EvalResult.per_trace(0.5, [1.0, 0.0], "1/2", correct=1)
    back = logic.decode_result(logic.encode_result(r))
    assert back.trace_rewards == (1.0, 0.0)
    assert back == r


CREDIT = {"weight": 0.5, "window": 3}


def test_partial_credit_ranks_near_misses_and_keeps_correct_exact():
    q2, q1 = ANSWERS
    traces = [trace(q2, "2"), trace(q2, "3"), trace(q2, "4"), trace(q1, "7"), trace(q1, "1.")]
    ctx = context([*traces, trace(q2, "02")])
    ctx.config["partial_credit"] = CREDIT
    r = evaluate(ctx)
    assert r.status == "ok"
    # exact 1; 1 away 0.5*(2/3); 2 away 0.5*(1/3); 6 away 0; "1." is not an integer: 0;
    # "02", the right number written otherwise, 0 away: the whole weight, still wrong
    assert r.trace_rewards == pytest.approx((1.0, 1 / 3, 1 / 6, 0.0, 0.0, 0.5))
    assert r.details["correct"] == 1  # what counts as correct is unchanged
    assert r.reason.startswith("1/6 answers correct")


def test_partial_credit_leaves_non_numeric_expected_answers_alone():
    answers = {"Capital of France?": "Paris"}
    ctx = context([trace("Capital of France?", "Lyon")], answers=answers)
    ctx.config["partial_credit"] = CREDIT
    assert evaluate(ctx).trace_rewards == (0.0,)


@pytest.mark.parametrize(
    "bad",
    [{"weight": 2}, {"window": 0}, {"window": 1.5}, {"windw": 3}, "yes", {"weight": "x"}],
)
def test_a_bad_partial_credit_config_is_an_evaluator_error(bad):
    q2, _ = ANSWERS
    ctx = context([trace(q2, "2")])
    ctx.config["partial_credit"] = bad
    r = evaluate(ctx)
    assert r.status == "error"
    assert "partial_credit" in r.reason
