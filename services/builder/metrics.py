"""The builder's Prometheus metrics (on top of the shared consumer metrics).

Tool-call parse health is counted here, the one service that sees every record, with
the session's harness and the model family that parsed each call, and by task for the
``RECENT_TASKS`` tasks built most recently only: task ids are unbounded (a trainer makes
one per prompt per step), so an older task's series is dropped from ``/metrics`` (its
counts stay on its trajectories' ``BuildStats`` and on the dashboard's task page).
"""

from __future__ import annotations

import contextlib
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import Iterable

from prometheus_client import Counter, Histogram

from schemas import CompletionRecord
from schemas.trajectory import checked_calls

BUILDS = Counter(
    "polar_builder_builds_total",
    "Sessions handled, by builder and result (built | fallback | skipped | retried)",
    ["builder", "result"],
)
TOKENS = Counter(
    "polar_builder_tokens_total",
    "Tokens: trainer (what a trainer processes), sampled, per_request (unmerged equivalent)",
    ["kind"],
)
MERGE_RATIO = Histogram(
    "polar_builder_merge_ratio",
    "Per-request tokens / built tokens, per session",
    buckets=(1, 1.5, 2, 3, 5, 8, 13, 21, 34, 55),
)
BREAKS = Counter("polar_builder_breaks_total", "Chains started, by break reason", ["reason"])
BUILD_SECONDS = Histogram(
    "polar_builder_build_seconds",
    "Time to build one session (read, build, store, announce)",
    buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120),
)


TOOL_CALLS_CHECKED = Counter(
    "polar_builder_tool_calls_checked_total",
    "Tool calls the model wrote on calls that offered tools, parsed or not",
    ["harness", "family"],
)
TOOL_CALLS_FAILED = Counter(
    "polar_builder_tool_calls_failed_total",
    "Tool calls that did not parse or check, by kind (malformed | unknown_tool | "
    "invalid_arguments)",
    ["harness", "family", "kind"],
)
TOOL_PARSE_SESSIONS = Counter(
    "polar_builder_tool_parse_sessions_total",
    "Sessions built with calls that offered tools, by whether any tool call failed "
    "(result: clean | failed)",
    ["harness", "family", "result"],
)
TASK_TOOL_CALLS = Counter(
    "polar_builder_task_tool_calls_total",
    "Tool calls on the most recently built tasks (result: checked | failed); a task's "
    "series is dropped when RECENT_TASKS newer tasks were built after it",
    ["task", "result"],
)
RECENT_TASKS = 100
_recent_tasks: OrderedDict[str, None] = OrderedDict()
UNKNOWN = "-"


def observe(trajectory, seconds: float) -> None:
    stats = trajectory.stats
    result = "fallback" if "build_error" in trajectory.metadata else "built"
    BUILDS.labels(trajectory.builder, result).inc()
    TOKENS.labels("trainer").inc(stats.tokens)
    TOKENS.labels("sampled").inc(stats.sampled_tokens)
    TOKENS.labels("per_request").inc(round(stats.tokens * stats.merge_ratio))
    if stats.tokens:
        MERGE_RATIO.observe(stats.merge_ratio)
    for reason, n in stats.breaks.items():
        BREAKS.labels(reason).inc(n)
    BUILD_SECONDS.observe(seconds)


def observe_tool_parse(
    harness: str | None, records: Iterable[CompletionRecord], task_id: str | None = None
) -> None:
    """Count one built session's tool-call parse health (its attempt's records)."""
    harness = harness or UNKNOWN
    failed_sessions: dict[str, bool] = {}
    checked = failed = 0
    for rec in records:
        parse = rec.tool_parse
        if parse is None:
            continue
        family = parse.family or UNKNOWN
        n_checked = checked_calls(parse)
        TOOL_CALLS_CHECKED.labels(harness, family).inc(n_checked)
        for kind, n in Tally(f.kind for f in parse.failures).items():
            TOOL_CALLS_FAILED.labels(harness, family, kind).inc(n)
        failed_sessions[family] = failed_sessions.get(family, False) or bool(parse.failures)
        checked, failed = checked + n_checked, failed + len(parse.failures)
    if task_id and failed_sessions:
        _recent_task(task_id)
        TASK_TOOL_CALLS.labels(task_id, "checked").inc(checked)
        TASK_TOOL_CALLS.labels(task_id, "failed").inc(failed)
    for family, failed in failed_sessions.items():
        TOOL_PARSE_SESSIONS.labels(harness, family, "failed" if failed else "clean").inc()


def _recent_task(task_id: str) -> None:
    """``task_id`` is the newest task; the one that falls out of the window is dropped."""
    if task_id in _recent_tasks:
        _recent_tasks.move_to_end(task_id)
        return
    _recent_tasks[task_id] = None
    while len(_recent_tasks) > RECENT_TASKS:
        old, _ = _recent_tasks.popitem(last=False)
        for result in ("checked", "failed"):
            with contextlib.suppress(KeyError):  # a series never counted
                TASK_TOOL_CALLS.remove(old, result)
