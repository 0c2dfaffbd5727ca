"""The evaluator registry and the guarded run of one evaluator.

``default_registry()`` holds the built-ins; a name of the form ``"module:Class"`` loads a
custom evaluator. ``run_evaluator`` enforces the timeout and turns a crash, a timeout or
an unusable return value into an explicit ``error`` result with the reason.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time

from evaluators.base import EvalContext, EvalResult, Evaluator, EvaluatorError, checked
from evaluators.command import CommandEvaluator
from evaluators.exact_answer import ExactAnswer
from evaluators.harbor import Harbor
from evaluators.rubric import Rubric
from evaluators.session_completed import SessionCompleted
from evaluators.swebench import SweBench
from evaluators.test_on_output import TestOnOutput
from services.common.plugins import PluginError, Registry

log = logging.getLogger(__name__)

EvaluatorRegistry = Registry[Evaluator]


BUILTINS: dict[str, type[Evaluator]] = {
    "session_completed": SessionCompleted,
    "test_on_output": TestOnOutput,
    "swebench": SweBench,
    "command": CommandEvaluator,
    "exact_answer": ExactAnswer,
    "rubric": Rubric,
    "harbor": Harbor,
}


NEEDS_RUNTIME = ("none", "task", "live", "fresh")


def _is_evaluator(cls: object) -> str | None:
    """Why the class ``cls`` is no evaluator (None: it is one), asked before it is called."""
    if not inspect.iscoroutinefunction(getattr(cls, "evaluate", None)):
        return "it has no `async def evaluate(ctx)` (subclass evaluators.Evaluator)"
    if getattr(cls, "needs_runtime", "task") not in NEEDS_RUNTIME:
        return f"needs_runtime must be none, task, live or fresh, not {cls.needs_runtime!r}"
    return None


def default_registry() -> EvaluatorRegistry:
    reg: EvaluatorRegistry = Registry("evaluator", check=_is_evaluator)
    for name, cls in BUILTINS.items():
        reg.register(name, cls)
    return reg


def may_read_workspace(name: str) -> bool:
    """Whether the evaluator ``name`` may look at the session's workspace (a runtime, the
    diff): False only for a built-in that says it needs no runtime. A custom one is not
    loaded here (the node need not have its module): it may."""
    cls = BUILTINS.get(name)
    return cls is None or cls.needs_runtime != "none"


def create_evaluator(registry: EvaluatorRegistry, name: str) -> Evaluator:
    """The evaluator ``name`` names; raises ``EvaluatorError`` saying why not."""
    try:
        evaluator = registry.create(name)
    except PluginError as exc:
        raise EvaluatorError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - custom code: importing or creating it may fail
        raise EvaluatorError(f"evaluator {name!r} could not be created: {exc!r}") from None
    if not inspect.iscoroutinefunction(getattr(evaluator, "evaluate", None)):
        raise EvaluatorError(f"evaluator {name!r} has no `async def evaluate(ctx)`")
    if getattr(evaluator, "needs_runtime", "task") not in NEEDS_RUNTIME:
        raise EvaluatorError(
            f"evaluator {name!r}: needs_runtime must be none, task, live or fresh, "
            f"not {evaluator.needs_runtime!r}"
        )
    return evaluator


async def run_evaluator(
    evaluator: Evaluator, ctx: EvalContext, timeout: float, name: str
) -> EvalResult:
    """Run ``evaluator`` within ``timeout`` seconds; never raises (but for cancellation)."""
    started = time.monotonic()
    ctx.deadline = min(ctx.deadline, started + timeout)
    try:
        result = await asyncio.wait_for(evaluator.evaluate(ctx), timeout)
    except TimeoutError as exc:
        if time.monotonic() - started < timeout * 0.99:  # its own, not our deadline
            return EvalResult.error(f"evaluator {name!r} raised TimeoutError: {exc}", **ctx.notes)
        return EvalResult.error(f"evaluator {name!r} timed out after {timeout:g}s", **ctx.notes)
    except EvaluatorError as exc:
        return EvalResult.error(f"evaluator {name!r}: {exc}", **ctx.notes)
    except Exception as exc:  # noqa: BLE001 - a plugin crash is a recorded error, not ours
        log.warning("evaluator %s crashed", name, exc_info=True)
        return EvalResult.error(
            f"evaluator {name!r} raised {type(exc).__name__}: {exc}", **ctx.notes
        )
    result = checked(result, name, len(ctx.trajectory.traces))
    if ctx.notes:
        result.details.update({k: v for k, v in ctx.notes.items() if k not in result.details})
    return result
