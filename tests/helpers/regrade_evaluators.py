"""An evaluator for re-grade tests: it reads only what a session stored (its transcript
and artifacts), so ``polar regrade`` runs it without a runtime."""

from __future__ import annotations

import orjson

from evaluators import EvalContext, EvalResult, Evaluator


class Mentions(Evaluator):
    """Reward ``config.reward`` (default 1.0) when ``config.needle`` is in the session's
    transcript, diff or stdout; 0.0 otherwise."""

    needs_runtime = "none"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        needle = str(ctx.config["needle"])
        transcript = b"".join(orjson.dumps(t.messages) for t in ctx.trajectory.traces)
        seen = (
            needle.encode() in transcript
            or needle in ctx.artifacts.diff + ctx.artifacts.stdout_tail
        )
        reward = float(ctx.config.get("reward", 1.0)) if seen else 0.0
        return EvalResult.ok(reward, f"{needle!r} {'found' if seen else 'not found'}")
