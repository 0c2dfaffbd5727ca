"""``exact_answer``: one reward per trace, 1.0 when the trace's answer is the expected one.

Config::

    answers: {"How many * in **.*..*.**?": "6", ...}   # question -> expected answer

Each trace is matched to its question by the last user message the model saw. Its
answer is the assistant turn the trace recorded when the builder put it in
``Trace.messages``, else what the agent reported for that question on stdout (a JSON line
``{"question": ..., "answer": ...}``, as ``infra/demo/quiz_agent.py`` prints). An answer
counts when, stripped, it is exactly the expected text (format is part of the task: "6."
or "six" is wrong). The session's reward is the mean of its traces' rewards (side calls
left out), a question the agent never asked counting as one more wrong answer. The reason says how many were right and
why the others were not.
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
        reported = reported_answers(ctx.artifacts.stdout_tail)
        traces = ctx.trajectory.traces
        verdicts = [judge(t, answers, reported) for t in traces]
        rewards = [1.0 if v == "correct" else 0.0 for v in verdicts]
        asked = {q for t in traces if (q := question_of(t)) in answers}
        scored = [r for r, v in zip(rewards, verdicts, strict=True) if v != "side_call"]
        missing = len(set(answers) - asked)
        reward = sum(scored) / (len(scored) + missing)
        return EvalResult.per_trace(
            reward,
            rewards,
            summary(verdicts, asked, answers),
            correct=int(sum(scored)),
            answered=len(scored),
            questions=len(answers),
        )
