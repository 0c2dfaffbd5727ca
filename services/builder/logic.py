"""The builder service's decisions, as plain functions (no network, no clock)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from schemas import (
    TERMINAL_STATES,
    BuilderSpec,
    BuildStats,
    CompletionRecord,
    Outcome,
    Session,
    SessionFinished,
    SessionState,
    Trace,
    Trajectory,
)
from services.builder.integrity import assess
from services.builder.strategies import BuilderRegistry, BuildError
from services.builder.strategies.base import full_calls, tool_counts
from services.builder.strategies.per_request import PerRequest

S = SessionState
FALLBACK_BUILDER = "per_request"


class Action(enum.StrEnum):
    BEGIN = "begin"  # POSTRUN: take it (POSTRUN -> BUILDING), then build
    RESUME = "resume"  # BUILDING: a build died midway; build again (every step is idempotent)
    SKIP = "skip"  # already built, or not ours to build
    RETRY = "retry"  # not finished yet: ask again later
    POISON = "poison"  # can never be built


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""


def decide(session: Session | None, event: SessionFinished) -> Decision:
    if session is None:
        return Decision(Action.POISON, f"no session {event.session_id!r} in the registry")
    if event.attempt != session.attempt:
        return Decision(
            Action.SKIP, f"finished attempt {event.attempt}, session is at {session.attempt}"
        )
    if session.state == S.POSTRUN:
        return Decision(Action.BEGIN)
    if session.state == S.BUILDING:
        return Decision(Action.RESUME, "found BUILDING: rebuilding after an interrupted build")
    if session.state == S.EVALUATING or session.state in TERMINAL_STATES:
        return Decision(Action.SKIP, f"session is {session.state}: already built or ended")
    return Decision(Action.RETRY, f"session is {session.state}, not POSTRUN yet")


def built_msg_id(session_id: str, attempt: int) -> str:
    return f"built:{session_id}:{attempt}"


@dataclass(frozen=True)
class Built:
    traces: list[Trace]
    stats: BuildStats
    notes: dict[str, Any]


def run_builder(
    builders: BuilderRegistry, spec: BuilderSpec, records: list[CompletionRecord], outcome: Outcome
) -> Built:
    """Run the task's builder and check what it returned. Raises on any failure."""
    result = builders.create(spec.name).build(records, dict(spec.config), outcome)
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise BuildError(f"builder {spec.name!r} returned {type(result).__name__}, not a tuple")
    traces, stats = result[0], result[1]
    notes = result[2] if len(result) == 3 else {}
    if not isinstance(stats, BuildStats) or not isinstance(notes, dict):
        raise BuildError(f"builder {spec.name!r} returned {type(stats).__name__} as stats")
    for t in traces:
        check_trace(t, spec.name)
    return Built(list(traces), stats, notes)


def check_trace(t: object, builder: str) -> None:
    if not isinstance(t, Trace):
        raise BuildError(f"builder {builder!r} returned a {type(t).__name__}, not a Trace")
    n = len(t.response_ids)
    if len(t.loss_mask) != n or len(t.response_logprobs) != n:
        raise BuildError(
            f"builder {builder!r}: trace {t.trace_id} has {n} response tokens but "
            f"{len(t.loss_mask)} mask and {len(t.response_logprobs)} logprob entries"
        )


def masked(t: Trace) -> Trace:
    return msgspec.structs.replace(t, loss_mask=[0] * len(t.loss_mask), trainable=False)


def apply_outcome(traces: list[Trace], outcome: Outcome, intact: bool, failed: bool):
    """(traces, policy). A session that did not complete is trainable with reward 0 only
    when intact, fully masked otherwise; a failed build is always fully masked."""
    if outcome != Outcome.COMPLETED:
        traces = [msgspec.structs.replace(t, reward=0.0) for t in traces]
        if intact and not failed:
            return traces, "zero_reward"
        return [masked(t) for t in traces], "masked"
    if failed:
        return [masked(t) for t in traces], "masked"
    return traces, "evaluate"


def fallback(records: list[CompletionRecord], outcome: Outcome) -> Built:
    try:
        traces, stats = PerRequest().build(records, {}, outcome)
    except Exception:  # noqa: BLE001 - last resort: an empty, flagged trajectory
        return Built([], BuildStats(completions=len(records)), {})
    return Built(traces, stats, {})


def build_trajectory(
    event: SessionFinished,
    spec: BuilderSpec,
    records: list[CompletionRecord],
    builders: BuilderRegistry,
    read_problems: Sequence[str] = (),
    quarantined: str | None = None,
) -> Trajectory:
    """The unscored trajectory of a finished session. Never raises for a bad build: a
    builder that fails yields per_request traces, fully masked, with the error recorded.
    ``quarantined``: why the task's builder is not run at all (building this session
    killed the service again and again); the same fallback, with that reason.

    Only the finished attempt's calls are built: a retried session's earlier attempts
    (a lost node, an expired lease) sampled tokens whose outcome nobody saw, and the
    reward this attempt earns says nothing about them. They are counted in the metadata
    (``earlier_attempt_records``) and still count for the lost-call check, since every
    attempt numbers its calls on one counter."""
    records, earlier = split_attempt(records, event.attempt)
    calls = full_calls(records)
    integrity = assess(calls, list(read_problems), (r.seq for r in earlier), event.seq_floor)
    error = quarantined
    try:
        if error is None:
            built = run_builder(builders, spec, records, event.outcome)
    except Exception as exc:  # noqa: BLE001 - builders are plugins: record, never crash
        error = f"{type(exc).__name__}: {exc}"
    if error is not None:
        built = fallback(records, event.outcome)
    intact = integrity.intact and error is None
    traces, policy = apply_outcome(built.traces, event.outcome, intact, error is not None)
    metadata: dict[str, Any] = {"reward_policy": policy, "records": len(records)}
    if earlier:
        metadata["earlier_attempt_records"] = len(earlier)
    if built.notes:
        metadata["builder_notes"] = built.notes
    if integrity.problems:
        metadata["integrity_problems"] = list(integrity.problems)
    if calls.duplicates:
        metadata["duplicate_seqs"] = calls.duplicates
    if error is not None:
        metadata["build_error"] = error
        metadata["fallback_builder"] = FALLBACK_BUILDER
    if event.reason:
        metadata["finish_reason"] = event.reason
    art = event.artifacts
    return Trajectory(
        session_id=event.session_id,
        task_id=event.task_id,
        attempt=event.attempt,
        outcome=event.outcome,
        builder=spec.name,
        traces=traces,
        reward=0.0 if event.outcome != Outcome.COMPLETED else None,
        intact=intact,
        # the parse counts are the records', whatever the builder (a plugin) said
        stats=msgspec.structs.replace(built.stats, **tool_counts(first_of_each_seq(records))),
        harness=art.harness,
        harness_version=art.harness_version,
        protocol=art.protocol or _protocol_of(records),
        metadata=metadata,
    )


def split_attempt(
    records: list[CompletionRecord], attempt: int
) -> tuple[list[CompletionRecord], list[CompletionRecord]]:
    """(the attempt's records, every other attempt's)."""
    mine = [r for r in records if r.attempt == attempt]
    return mine, [r for r in records if r.attempt != attempt]


def first_of_each_seq(records: list[CompletionRecord]) -> list[CompletionRecord]:
    """One record per call number, the first (a redelivered record is a copy)."""
    by_seq: dict[int, CompletionRecord] = {}
    for rec in records:
        by_seq.setdefault(rec.seq, rec)
    return list(by_seq.values())


def _protocol_of(records: list[CompletionRecord]) -> str | None:
    return str(records[0].protocol) if records else None


def all_numbered_present(records, numbered: int, floor: int = 0) -> bool:
    """Does every call number from ``floor`` (the attempt's first) below ``numbered``
    (the proxy's counter) have a record?"""
    return {r.seq for r in records} >= set(range(floor, numbered))
