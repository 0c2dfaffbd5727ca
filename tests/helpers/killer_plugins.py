"""Plugins that end their own process (loaded by "module:Class"): a service must
quarantine the session, not crash-loop on it (issue 33)."""

from __future__ import annotations

import os

from evaluators.base import EvalContext, EvalResult, Evaluator


class ExitsProcess(Evaluator):
    """Ends its process at once, without unwinding, as ``os.abort``, a segfault or the OOM
    killer would: the message it was handed is never settled."""

    needs_runtime = "none"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        os._exit(70)
