"""``exact_answer``: one reward per trace, 1.0 when the trace's answer is the expected one.

Config::

    answers: {"How many * in **.*..*.**?": "6", ...}   # question -> expected answer
    partial_credit: {weight: 0.5, window: 3}            # optional, numeric answers only

Each trace is matched to its question by the last user message the model saw. Its
answer is the assistant turn the trace recorded when the builder put it in
``Trace.messages``, else what the agent reported for that question on stdout (a JSON line
``{"question": ..., "answer": ...}``, as ``infra/demo/quiz_agent.py`` prints). An answer
counts when, stripped, it is exactly the expected text (format is part of the task: "6."
or "six" is wrong). The session's reward is the mean of its traces' rewards (side calls
left out), a question the agent never asked counting as one more wrong answer. The reason says how many were right and
why the others were not.

``partial_credit`` shapes a *training* reward: a wrong answer that is an integer ``d``
away from an integer expected answer earns ``weight * (1 - d / window)`` (nothing from
``window`` on; ``d`` = 0 is the right number written otherwise, "03" for "3", which earns
the whole weight), so a group whose samples are all wrong still ranks the near misses
above the far ones. It never changes what counts as correct (``correct`` in the details, the
reason), and a held-out set is scored without it.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from evaluators.base import EvalContext, EvalResult, Evaluator, EvaluatorError
from schemas import Trace


def expected_answers(config: dict[str, Any]) -> dict[str, str]:
    answers = config.get("answers")
    if not isinstance(answers, dict) or not answers:
        raise EvaluatorError("config.answers must be a non-empty {question: answer} mapping")
    return {str(q): str(a).strip() for q, a in answers.items()}


def reported_answers(stdout: str) -> dict[str, str]:
    """``{"question": q, "answer": a}`` lines of the agent's stdout; other lines ignored."""
    found: dict[str, str] = {}
    for line in stdout.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and isinstance(item.get("question"), str):
            found[item["question"]] = str(item.get("answer") or "")
    return found


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def question_of(trace: Trace) -> str | None:
    """The last user message before the trace's answer."""
    users = [m for m in trace.messages if m.get("role") == "user"]
    return _text(users[-1]) if users else None


def answer_of(trace: Trace, reported: dict[str, str], question: str) -> str | None:
    last = trace.messages[-1] if trace.messages else None
    if last is not None and last.get("role") == "assistant":
        return _text(last)
    return reported.get(question)


def partial_credit(config: dict[str, Any]) -> tuple[float, int] | None:
    """(weight, window) from ``config.partial_credit``, or None when it is not set."""
    spec = config.get("partial_credit")
    if spec is None:
        return None
    if not isinstance(spec, dict) or set(spec) - {"weight", "window"}:
        raise EvaluatorError("config.partial_credit must be {weight: 0..1, window: >= 1}")
    weight, window = spec.get("weight", 0.5), spec.get("window", 3)
    if not isinstance(weight, int | float) or not 0 <= weight <= 1:
        raise EvaluatorError(f"config.partial_credit.weight must be in [0, 1], not {weight!r}")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise EvaluatorError(
            f"config.partial_credit.window must be an integer >= 1, not {window!r}"
        )
    return float(weight), window


def near_miss(got: str, expected: str, credit: tuple[float, int]) -> float:
    """The partial reward of a wrong answer: both integers, ``d`` apart, ``d < window``."""
    weight, window = credit
    try:
        distance = abs(int(got.strip()) - int(expected))
    except ValueError:
        return 0.0
    return weight * max(0.0, 1.0 - distance / window)


def judge(trace: Trace, answers: dict[str, str], reported: dict[str, str]) -> str:
    """``correct`` or why not: ``wrong``, ``no_answer``, ``unknown_question``, ``side_call``."""
    if trace.side_call:
        return "side_call"
    question = question_of(trace)
    if question is None or question not in answers:
        return "unknown_question"
    got = answer_of(trace, reported, question)
    if got is None:
        return "no_answer"
    return "correct" if got.strip() == answers[question] else "wrong"


def trace_reward(
    trace: Trace,
    verdict: str,
    answers: dict[str, str],
    reported: dict[str, str],
    credit: tuple[float, int] | None,
) -> float:
    if verdict == "correct":
        return 1.0
    if verdict != "wrong" or credit is None:
        return 0.0
    question = question_of(trace)
    assert question is not None  # "wrong" is judged on a known question
    return near_miss(answer_of(trace, reported, question) or "", answers[question], credit)


def summary(verdicts: list[str], asked: set[str], answers: dict[str, str]) -> str:
    counts = Counter(verdicts)
    missing = len(set(answers) - asked)
    reason = f"{counts['correct']}/{len(verdicts) - counts['side_call']} answers correct"
    others = [f"{counts[k]} {k}" for k in ("wrong", "no_answer", "unknown_question") if counts[k]]
    if missing:
        others.append(f"{missing} questions not asked")
    return reason + (f" ({', '.join(others)})" if others else "")


class ExactAnswer(Evaluator):
    name = "exact_answer"
    needs_runtime = "none"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        answers = expected_answers(ctx.config)
        credit = partial_credit(ctx.config)
        reported = reported_answers(ctx.artifacts.stdout_tail)
        traces = ctx.trajectory.traces
        verdicts = [judge(t, answers, reported) for t in traces]
        rewards = [
            trace_reward(t, v, answers, reported, credit)
            for t, v in zip(traces, verdicts, strict=True)
        ]
        asked = {q for t in traces if (q := question_of(t)) in answers}
        scored = [r for r, v in zip(rewards, verdicts, strict=True) if v != "side_call"]
        missing = len(set(answers) - asked)
        reward = sum(scored) / (len(scored) + missing)
        return EvalResult.per_trace(
            reward,
            rewards,
            summary(verdicts, asked, answers),
            correct=sum(1 for v in verdicts if v == "correct"),
            answered=len(scored),
            questions=len(answers),
        )
