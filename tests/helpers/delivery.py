"""The builder and the evaluator, in-process and drained: what follows a session's end."""

from __future__ import annotations

from services.builder.config import BuilderConfig
from services.builder.handlers import Builder
from services.builder.main import consumers as builder_consumers
from services.evaluator.config import EvaluatorConfig
from services.evaluator.handlers import EvaluatorService
from services.evaluator.main import consumers as evaluator_consumers


async def deliver(bus, registry, work_dir) -> None:
    """Build and evaluate every finished session queued, then return."""
    for c in builder_consumers(Builder(bus, registry, BuilderConfig())):
        await c.run(drain=True)
    evaluator = EvaluatorService(bus, registry, EvaluatorConfig(work_dir=str(work_dir)))
    for c in evaluator_consumers(evaluator):
        await c.run(drain=True)
