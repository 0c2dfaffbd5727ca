"""A slow builder and evaluator (custom plugins by "module:Class") that log every start,
so a crash test can prove its kills interrupted real work."""

from __future__ import annotations

import asyncio
import os
import time

from evaluators.base import EvalContext, EvalResult, Evaluator
from services.builder.strategies.prefix_merging import PrefixMerging


def _mark(kind: str, session_id: str) -> None:
    path = os.environ.get("POLAR_TEST_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(f"{kind} {session_id}\n")


class TracedBuilder(PrefixMerging):
    name = "traced_builder"

    def build(self, records, config, outcome):
        _mark("build", records[0].session_id if records else "?")
        time.sleep(0.1)
        return super().build(records, config, outcome)


class TracedEvaluator(Evaluator):
    name = "traced_evaluator"
    needs_runtime = "none"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        _mark("eval", ctx.trajectory.session_id)
        await asyncio.sleep(0.1)
        return EvalResult.ok(1.0)
