"""The evaluator interface: an async ``evaluate(ctx) -> EvalResult``.

An evaluator says what it needs to run (``needs_runtime``):

- ``"none"``: it judges from the trajectory and artifacts alone;
- ``"task"``: a runtime, the one the task's ``evaluator.runtime`` names (live or fresh);
- ``"live"`` / ``"fresh"``: that kind, whatever the task says.

It returns an ``EvalResult``; it may also raise or run past its timeout; the service
turns either into an explicit ``error`` result with the reason (never a silent 0).

An evaluator that calls a model itself (``rubric``'s judge) records each call through
``ctx.side_calls`` as one of the session's ``CompletionRecord``s, tagged ``side_call``.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from schemas import Artifacts, CompletionRecord, TaskRequest, Trajectory

NeedsRuntime = Literal["none", "task", "live", "fresh"]
RuntimeKind = Literal["live", "fresh"]


@dataclass(frozen=True)
class EvalResult:
    """``reward`` is the session's; ``trace_rewards``, when given, is one reward per trace
    of the trajectory, in order (otherwise every trace gets ``reward``)."""

    status: Literal["ok", "error"]
    reward: float | None
    reason: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    trace_rewards: tuple[float, ...] | None = None

    @classmethod
    def ok(cls, reward: float, reason: str | None = None, **details: Any) -> EvalResult:
        return cls("ok", float(reward), reason, details)

    @classmethod
    def per_trace(
        cls, reward: float, trace_rewards: list[float], reason: str | None = None, **details: Any
    ) -> EvalResult:
        return cls("ok", float(reward), reason, details, tuple(float(r) for r in trace_rewards))

    @classmethod
    def error(cls, reason: str, **details: Any) -> EvalResult:
        return cls("error", None, reason, details)


class EvaluatorError(Exception):
    """An evaluator cannot judge this session (bad config, diff does not apply, ...)."""


class SideCalls(Protocol):
    """Where an evaluator's own model calls go: the session's records, numbered after
    the harness's calls (the evaluator runs after the build, so no builder sees them;
    the dashboard and the session's records do). The evaluator service's is
    ``services/evaluator/sidecalls.py``."""

    async def number(self) -> int:
        """The next call number of the session: the record's ``seq``."""
        ...

    async def commit(self, record: CompletionRecord) -> None:
        """Publish ``record`` (numbered by ``number``); an ``EvaluatorError`` when it
        cannot be committed (its number is then given back)."""
        ...


@dataclass
class EvalContext:
    trajectory: Trajectory
    artifacts: Artifacts
    task: TaskRequest
    config: dict[str, Any]
    runtime: Any = None  # services.runtimes.base.Runtime, when one was asked for
    runtime_kind: RuntimeKind | None = None
    deadline: float = math.inf  # time.monotonic() by which the evaluation must end
    notes: dict[str, Any] = field(default_factory=dict)  # e.g. why a runtime was swapped
    side_calls: SideCalls | None = None  # the evaluator's own model calls are recorded here

    def remaining(self, floor: float = 1.0) -> float:
        """Seconds left before the deadline (at least ``floor``, for exec timeouts)."""
        return max(self.deadline - time.monotonic(), floor)

    def require_runtime(self) -> Any:
        if self.runtime is None:
            raise EvaluatorError("this evaluator needs a runtime and none was given")
        return self.runtime


class Evaluator(ABC):
    """Base class of built-in and custom evaluators (``"module:Class"``)."""

    name: str = "evaluator"
    needs_runtime: NeedsRuntime = "task"

    @abstractmethod
    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        """The reward of one session (or an error result saying why there is none)."""


def checked(result: object, name: str, traces: int | None = None) -> EvalResult:
    """What an evaluator returned, or an error result saying why it is not usable
    (``traces``: how many per-trace rewards it must give, when it gives them)."""
    if not isinstance(result, EvalResult):
        return EvalResult.error(
            f"evaluator {name!r} returned {type(result).__name__}, not EvalResult"
        )
    if result.status == "error":
        return EvalResult.error(result.reason or f"evaluator {name!r} failed", **result.details)
    if result.status != "ok":
        return EvalResult.error(f"evaluator {name!r} returned status {result.status!r}")
    if result.reward is None or not math.isfinite(result.reward):
        return EvalResult.error(f"evaluator {name!r} returned reward {result.reward!r}")
    per_trace = result.trace_rewards
    if per_trace is not None:
        if traces is not None and len(per_trace) != traces:
            return EvalResult.error(
                f"evaluator {name!r} gave {len(per_trace)} trace rewards for {traces} traces"
            )
        if not all(math.isfinite(r) for r in per_trace):
            return EvalResult.error(f"evaluator {name!r} returned trace rewards {per_trace!r}")
    return result
