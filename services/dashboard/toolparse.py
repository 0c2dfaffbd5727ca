"""Tool-call parse health as the pages show it: "tool calls: N parsed, M failed (kinds)"
for a model call, a session, a trace and a task, and each failure with its token span.

Every summary is ``{"parsed", "failed", "kinds": {kind: count}}`` plus what its page
adds; None where no call offered tools (nothing was checked, nothing to show).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from schemas import Trajectory
from schemas.completion import ToolParse, ToolParseFailure
from schemas.trajectory import ToolFailure, TraceToolParse, checked_calls


def summary(checked: int, kinds: Iterable[str] | dict[str, int]) -> dict[str, Any]:
    """``checked`` tool calls, of which failed: ``kinds`` (one kind per failure, or the
    counts by kind)."""
    by_kind = Counter(kinds)
    failed = sum(by_kind.values())
    return {
        "parsed": max(checked - failed, 0),
        "failed": failed,
        "kinds": dict(sorted(by_kind.items())),
    }


def merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
    kinds: Counter[str] = Counter()
    for p in parts:
        kinds.update(p["kinds"])
    return summary(sum(p["parsed"] + p["failed"] for p in parts), kinds)


def of_call(parse: ToolParse | None) -> dict[str, Any] | None:
    """One model call's; a failure's ``start``/``end`` index its output tokens."""
    if parse is None:
        return None
    return {
        **summary(checked_calls(parse), (f.kind for f in parse.failures)),
        "family": parse.family,
        "failures": [failure(f) for f in parse.failures],
    }


def failure(f: ToolParseFailure | ToolFailure) -> dict[str, Any]:
    return {"kind": f.kind, "detail": f.detail, "start": f.start, "end": f.end}


def of_session(calls: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A session's, over its calls' (``views.model_call``): no build needed, so it shows
    while the session runs; ``failed_calls`` are the seqs of the calls with a failure."""
    checked = [c for c in calls if c["tool_parse"] is not None]
    if not checked:
        return None
    return {
        **merged([c["tool_parse"] for c in checked]),
        "turns": len(checked),
        "failed_calls": [c["seq"] for c in checked if c["tool_parse"]["failed"]],
    }


def of_trace(tp: TraceToolParse | None) -> dict[str, Any] | None:
    """A trace's; a failure's ``start``/``end`` index its response tokens (-1: the whole
    call)."""
    if tp is None:
        return None
    return {
        **summary(tp.checked, (f.kind for f in tp.failures)),
        "family": tp.family,
        "turns": tp.turns,
        "failures": [{"seq": f.seq, **failure(f)} for f in tp.failures],
    }


def of_built(traj: Trajectory | None) -> dict[str, Any] | None:
    """A built session's, from its ``BuildStats``."""
    if traj is None or not traj.stats.tool_turns:
        return None
    return summary(traj.stats.tool_calls_checked, traj.stats.tool_calls_failed)


def of_task(members: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A task's: its built sessions' summed, and how many of them had a tool call that
    failed (the "N of M rollouts with unparsed calls" number)."""
    shown = [m["tool_parse"] for m in members if m["tool_parse"] is not None]
    if not shown:
        return None
    return {
        **merged(shown),
        "sessions": len(shown),
        "sessions_failed": sum(1 for tp in shown if tp["failed"]),
    }
