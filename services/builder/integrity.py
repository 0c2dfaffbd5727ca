"""Is a session's capture whole? Problems that make a trajectory not intact."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.builder.strategies.base import Call, Calls, starts_with


@dataclass(frozen=True)
class Integrity:
    intact: bool
    problems: tuple[str, ...]


def missing_seqs(calls: Calls, elsewhere: Iterable[int] = (), floor: int = 0) -> list[int]:
    """Call numbers from ``floor`` (the attempt's first: ``Session.seq_floor``) below the
    highest one seen that have no record; ``elsewhere`` are numbers recorded outside
    ``calls`` (an earlier attempt's, which share the counter)."""
    seqs = (
        {c.seq for c in calls.calls}
        | set(calls.unreconstructable)
        | set(calls.void)
        | set(elsewhere)
    )
    return sorted(set(range(floor, max(seqs) + 1)) - seqs) if seqs else []


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
    elsewhere: Iterable[int] = (),
    floor: int = 0,
) -> Integrity:
    """Not intact when a completion is missing or unreadable, or a turn was cut mid-chain
    (aborted or errored, and the conversation went on after it). A cut last turn (a
    timeout ending the session mid-call) keeps the trace intact: every token in it was
    sampled and reported. ``elsewhere``: call numbers other attempts recorded; below
    ``floor``, numbers earlier attempts took (recorded or not: not this attempt's loss)."""
    problems = list(read_problems)
    missing = missing_seqs(calls, elsewhere, floor)
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
