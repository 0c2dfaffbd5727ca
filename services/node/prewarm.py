"""Evaluator prewarm: a fresh eval runtime started and prepared while the harness runs.

It is stopped on every path except one: a session-finished event that names it hands it
to the evaluator. Its id is deterministic (role ``eval``), so the reaper of a node whose
executor died finds and stops it from the task's spec and the session's attempt alone
(``prewarm_runtime_id``).
"""

from __future__ import annotations

import asyncio
import logging

from services.runtimes.base import Runtime
from services.runtimes.factory import runtime_id_for
from services.runtimes.prepare import run_prepare

log = logging.getLogger(__name__)
ROLE = "eval"


def wants_prewarm(spec) -> bool:
    ev = spec.evaluator
    return bool(ev.prewarm and ev.runtime == "fresh")


def prewarm_runtime_id(spec, session_id: str, attempt: int) -> str | None:
    """The eval runtime an attempt of a RUNNING session of this task may have started."""
    return runtime_id_for(session_id, attempt, ROLE) if wants_prewarm(spec) else None


class Prewarm:
    def __init__(self, runtime: Runtime, prepare) -> None:
        self.runtime = runtime
        self._task = asyncio.create_task(self._start(prepare))

    async def _start(self, prepare) -> None:
        await self.runtime.start()
        logs = await run_prepare(self.runtime, prepare)
        failed = next((a for a in logs if not a.ok), None)
        if failed is not None:
            raise RuntimeError(f"prepare action {failed.index} ({failed.action}) failed")

    async def ready(self) -> Runtime | None:
        """The prepared runtime, or None (failed: stopped; the evaluator starts its own)."""
        try:
            await self._task
        except Exception as exc:  # noqa: BLE001 - only a missed head start
            log.warning("eval prewarm of %s failed: %s", self.runtime.session_id, exc)
            await self.stop()
            return None
        return self.runtime

    async def stop(self, grace: float = 0.0) -> None:
        """Stop it wherever it is (starting, preparing, ready); idempotent."""
        if not self._task.done():
            self._task.cancel()
            await asyncio.wait([self._task])  # its start/prepare unwinds before the stop
        if not self._task.cancelled():
            self._task.exception()  # retrieved: a failure was logged or is moot
        await self.runtime.stop(grace)
