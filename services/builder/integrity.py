"""Is a session's capture whole? Problems that make a trajectory not intact."""

from __future__ import annotations

from dataclasses import dataclass

from services.builder.strategies.base import Call, Calls, starts_with


@dataclass(frozen=True)
class Integrity:
    intact: bool
    problems: tuple[str, ...]


def missing_seqs(calls: Calls, elsewhere: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Call numbers below the highest one with no record (``elsewhere``: numbers taken by
    another attempt of the session, not missing)."""
    seqs = {c.seq for c in calls.calls} | set(calls.unreconstructable) | set(calls.void)
    return sorted(set(range(max(seqs) + 1)) - seqs - set(elsewhere)) if seqs else []


def continuation_of(cut: Call, calls: list[Call]) -> Call | None:
    """A later main-loop call that goes on from the cut call's conversation."""
    for c in calls:
        if c.seq > cut.seq and c.rec.side_call is None and starts_with(c.prompt, cut.prompt):
            return c
    return None


def cut_description(call: Call) -> str:
    if call.rec.error is not None:
        return f"errored ({call.rec.error[:200]})"
    return "was aborted"


def assess(
    calls: Calls,
    read_problems: list[str] | tuple[str, ...] = (),
    elsewhere: set[int] | frozenset[int] = frozenset(),
) -> Integrity:
    """Not intact when a completion is missing or unreadable, or a turn was cut mid-chain
    (aborted or errored, and the conversation went on after it). A cut last turn (a
    timeout ending the session mid-call) keeps the trace intact: every token in it was
    sampled and reported."""
    problems = list(read_problems)
    missing = missing_seqs(calls, elsewhere)
    if missing:
        problems.append(f"completions missing from the capture: seqs {missing[:50]}")
    if calls.unreconstructable:
        problems.append(
            f"prompts not reconstructable (base record missing): seqs {calls.unreconstructable[:50]}"
        )
    for call in calls.calls:
        if call.cut and call.rec.side_call is None:
            later = continuation_of(call, calls.calls)
            if later is not None:
                problems.append(
                    f"seq {call.seq} {cut_description(call)} mid-chain; "
                    f"the conversation went on at seq {later.seq}"
                )
    return Integrity(not problems, tuple(problems))
