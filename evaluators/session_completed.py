"""``session_completed``: 1.0 if the harness run completed, else 0.0."""

from __future__ import annotations

from evaluators.base import EvalContext, EvalResult, Evaluator
from schemas import Outcome


class SessionCompleted(Evaluator):
    name = "session_completed"
    needs_runtime = "none"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        outcome = ctx.trajectory.outcome
        if outcome == Outcome.COMPLETED:
            return EvalResult.ok(1.0, outcome=outcome.value)
        return EvalResult.ok(0.0, f"session ended {outcome.value}", outcome=outcome.value)
