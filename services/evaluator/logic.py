"""The evaluator service's decisions, as plain functions (no network, no clock)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from evaluators import EvalResult
from schemas import (
    TERMINAL_STATES,
    Outcome,
    Session,
    SessionScored,
    SessionState,
    Trajectory,
    TrajectoryBuilt,
)
from services.common.redact import redact, redact_struct

S = SessionState


class Action(enum.StrEnum):
    EVALUATE = "evaluate"  # EVALUATING: evaluate (or reuse a kept result), deliver, finish
    FINALIZE = "finalize"  # already final: finish what a crashed delivery left (idempotent)
    SKIP = "skip"  # not ours: another attempt, or never built
    # BUILDING, though its trajectory is built and announced: the builder's own move to
    # EVALUATING comes after the announce and can lag (a registry outage); the evaluator
    # makes it, so no waiting budget can run out and strand the session BUILDING
    ADVANCE = "advance"
    POISON = "poison"  # can never be evaluated


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""


def decide(session: Session | None, event: TrajectoryBuilt) -> Decision:
    if session is None:
        return Decision(Action.POISON, f"no session {event.session_id!r} in the registry")
    if event.attempt != session.attempt:
        return Decision(
            Action.SKIP, f"built attempt {event.attempt}, session is at {session.attempt}"
        )
    if session.state == S.EVALUATING:
        return Decision(Action.EVALUATE)
    if session.state == S.BUILDING:  # the builder announces, then advances
        return Decision(Action.ADVANCE, "built, still BUILDING: moved to EVALUATING here")
    if session.state in TERMINAL_STATES:
        return Decision(Action.FINALIZE, f"session is already {session.state}")
    return Decision(Action.SKIP, f"session is {session.state}: not built")


@dataclass(frozen=True)
class Plan:
    evaluate: bool
    result: EvalResult | None = None  # the fixed result when not evaluating


def plan(trajectory: Trajectory) -> Plan:
    """The reward rules by outcome. A completed session is evaluated. One that timed out
    or failed gets reward 0.0 without evaluation: trainable when its trajectory is intact,
    fully masked (by the builder) when not."""
    if trajectory.outcome == Outcome.COMPLETED:
        return Plan(evaluate=True)
    reason = f"session ended {trajectory.outcome.value}: reward 0 by rule"
    policy = trajectory.metadata.get("reward_policy")
    masked = not trajectory.intact or policy == "masked"
    if masked:
        reason += "; trajectory not intact: fully masked"
    return Plan(evaluate=False, result=EvalResult.ok(0.0, reason, rule="outcome", masked=masked))


def runtime_kind(needs_runtime: str, task_runtime: str) -> str | None:
    """Which runtime an evaluator gets: none, or the task's kind unless it insists."""
    if needs_runtime == "none":
        return None
    if needs_runtime in ("live", "fresh"):
        return needs_runtime
    return task_runtime


def score(
    trajectory: Trajectory, result: EvalResult, *, num_samples: int, index: int
) -> Trajectory:
    """The scored trajectory a trainer receives: reward on it and on every trace (each
    trace's own when the evaluator gave per-trace rewards), the evaluation's status and
    reason, and what a GRPO group needs (``num_samples``)."""
    reward = result.reward if result.status == "ok" else None
    metadata: dict[str, Any] = {
        **trajectory.metadata,
        "num_samples": num_samples,
        "sample_index": index,
    }
    if result.details:
        metadata["eval_details"] = result.details
    per_trace = result.trace_rewards if reward is not None else None
    rewards = list(per_trace) if per_trace is not None else [reward] * len(trajectory.traces)
    scored = msgspec.structs.replace(
        trajectory,
        traces=[
            msgspec.structs.replace(t, reward=r)
            for t, r in zip(trajectory.traces, rewards, strict=True)
        ],
        reward=reward,
        eval_status=result.status,
        eval_reason=result.reason,
        metadata=metadata,
    )
    # Tool output, CLI errors and reasons may hold the session token or an API key.
    # Token ids stay as sampled (what the model saw); text fields are redacted.
    return redact_struct(scored)


def final_fields(result: EvalResult) -> dict[str, Any]:
    """Registry fields of the final transition (``reward`` and ``eval_reason`` feed the
    TaskResult: a reward 0 comes with the evaluator's why)."""
    fields: dict[str, Any] = {"eval_status": result.status, "eval_reason": result.reason}
    if result.status == "ok":
        fields["reward"] = result.reward
    else:
        fields["reason"] = f"evaluator error: {result.reason}"
    return fields


def scored_event(event: TrajectoryBuilt, result: EvalResult, ts: float) -> SessionScored:
    return SessionScored(
        ts=ts,
        session_id=event.session_id,
        task_id=event.task_id,
        outcome=event.outcome,
        reward=result.reward if result.status == "ok" else None,
        attempt=event.attempt,
        eval_status=result.status,
        reason=redact(result.reason),
    )


def trajectory_msg_id(session_id: str, attempt: int) -> str:
    """The dedupe id of a scored trajectory on ``polar.trajectories.<task>``."""
    return f"traj:{session_id}:{attempt}"


def scored_msg_id(session_id: str, attempt: int) -> str:
    return f"scored:{session_id}:{attempt}"


def encode_result(result: EvalResult) -> bytes:
    """JSON of a result (details that are not JSON become strings), kept so a
    redelivery reuses it byte for byte."""
    data = {
        "status": result.status,
        "reward": result.reward,
        "reason": result.reason,
        "details": result.details,
        "trace_rewards": result.trace_rewards,
    }
    return orjson.dumps(data, default=str, option=orjson.OPT_NON_STR_KEYS)


def decode_result(raw: bytes) -> EvalResult:
    data = orjson.loads(raw)
    per_trace = data.get("trace_rewards")
    return EvalResult(
        data["status"],
        data["reward"],
        data.get("reason"),
        data.get("details") or {},
        tuple(per_trace) if per_trace is not None else None,
    )
