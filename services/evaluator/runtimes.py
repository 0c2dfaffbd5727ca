"""The runtime an evaluation runs in: adopted (live, or a prewarmed fresh one) or new.

The executor leaves the live runtime running when the task's evaluator wants it, or a
prewarmed fresh one, and names it in ``eval_runtime_id``; otherwise a fresh runtime is
started here (role ``eval``, named by the session's attempt) and prepared like the
task's. Whatever an evaluation used or was left is stopped afterwards; stopping is
idempotent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from evaluators import EvaluatorError
from schemas import TaskRequest, TrajectoryBuilt
from services.evaluator.config import EvaluatorConfig
from services.node.session import node_runtime
from services.runtimes.factory import runtime_id_for
from services.runtimes.prepare import run_prepare

log = logging.getLogger(__name__)


@dataclass
class Acquired:
    runtime: Any
    kind: str  # live | fresh
    notes: dict[str, Any] = field(default_factory=dict)


def fresh_runtime_id(session_id: str, attempt: int) -> str:
    return runtime_id_for(session_id, attempt, "eval")


class EvalRuntimes:
    def __init__(self, config: EvaluatorConfig) -> None:
        self.config = config

    def adopt(self, task: TaskRequest, session_id: str, runtime_id: str) -> Any:
        return node_runtime(
            self.config, task.runtime, session_id, runtime_id=runtime_id, harness=task.agent.harness
        )

    def left_here(self, event: TrajectoryBuilt) -> str | None:
        """The runtime the session left for its evaluation, if this evaluator reaches it
        (a node queue taken over from a gone host holds runtimes out of reach)."""
        if event.node is not None and event.node not in self.config.reachable_nodes:
            return None
        return event.eval_runtime_id

    async def acquire(
        self, kind: str, task: TaskRequest, event: TrajectoryBuilt, on_fresh
    ) -> Acquired:
        """A running runtime of ``kind``; raises EvaluatorError when none can be had.
        ``on_fresh`` is awaited before a fresh runtime is created (to note it)."""
        given = self.left_here(event)
        if kind == "live":
            if given and task.evaluator.runtime == "live":
                return Acquired(self.adopt(task, event.session_id, given), "live")
            notes = {"runtime": "fresh: the live runtime was not kept"}
            if event.eval_runtime_id and not given:
                notes = {"runtime": f"fresh: the live runtime is on node {event.node}, gone"}
            return Acquired(await self._fresh(task, event, on_fresh), "fresh", notes)
        if given and task.evaluator.runtime == "fresh":  # prewarmed during RUNNING
            return Acquired(self.adopt(task, event.session_id, given), "fresh", {"prewarmed": True})
        return Acquired(await self._fresh(task, event, on_fresh), "fresh")

    async def _fresh(self, task: TaskRequest, event: TrajectoryBuilt, on_fresh) -> Any:
        await on_fresh()
        rt = node_runtime(
            self.config, task.runtime, event.session_id, role="eval", attempt=event.attempt,
            harness=task.agent.harness,
        )  # fmt: skip
        try:
            await rt.start()
            logs = await run_prepare(rt, task.runtime.prepare)
        except Exception as exc:  # noqa: BLE001 - sandbox errors become the eval's reason
            await rt.stop()
            raise EvaluatorError(f"fresh eval runtime did not start: {exc}") from None
        failed = [a for a in logs if not a.ok]
        if failed:
            await rt.stop()
            last = failed[0].attempts[-1] if failed[0].attempts else None
            detail = (last.error or last.stderr[-500:] or last.stdout[-500:]) if last else ""
            raise EvaluatorError(
                f"fresh eval runtime: prepare action {failed[0].target!r} failed: {detail}"
            )
        return rt

    async def release(self, task: TaskRequest, event: TrajectoryBuilt, fresh: bool) -> None:
        """Stop what the session left for evaluation (when it is here to stop: a gone
        node's start-up sweep stops its own) and any fresh runtime made for it."""
        left = self.left_here(event)
        ids = {left} if left else set()
        if fresh:
            ids.add(fresh_runtime_id(event.session_id, event.attempt))
        for runtime_id in sorted(ids):
            try:
                rt = self.adopt(task, event.session_id, runtime_id)
                await rt.stop(self.config.stop_grace_seconds)
            except Exception as exc:  # noqa: BLE001 - cleanup must not fail the delivery
                log.warning(
                    "%s: could not stop eval runtime %s: %s", event.session_id, runtime_id, exc
                )
