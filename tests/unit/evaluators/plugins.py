"""Custom evaluators for tests, loaded by name as ``tests.unit.evaluators.plugins:Class``."""

from __future__ import annotations

import asyncio
import random

from evaluators import EvalContext, EvalResult, Evaluator


class Crashing(Evaluator):
    needs_runtime = "none"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        raise ValueError("grader exploded")


class Sleeping(Evaluator):
    needs_runtime = "none"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        await asyncio.sleep(float(ctx.config.get("sleep", 60)))
        return EvalResult.ok(1.0)


class BadReturn(Evaluator):
    needs_runtime = "none"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        return 1.0  # type: ignore[return-value]


class NanReward(Evaluator):
    needs_runtime = "none"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        return EvalResult.ok(float("nan"))


class NotAnEvaluator:
    def evaluate(self, ctx):  # not async
        return EvalResult.ok(1.0)


class Jitter(Evaluator):
    """Reward 1.0 after a short random pause: evaluations overlap and a kill -9 lands
    mid-evaluation."""

    needs_runtime = "none"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        await asyncio.sleep(random.uniform(0.01, float(ctx.config.get("max_sleep", 0.1))))
        return EvalResult.ok(1.0, session=ctx.trajectory.session_id)


class WorkdirProbe(Evaluator):
    """Reports which runtime it got and what the workdir holds."""

    needs_runtime = "task"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        rt = ctx.require_runtime()
        run = await rt.exec("ls -a", timeout=10)
        files = sorted(run.stdout.decode().split())
        return EvalResult.ok(1.0, kind=ctx.runtime_kind, runtime_id=rt.runtime_id, files=files)
