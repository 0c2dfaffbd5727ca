"""What each dashboard page shows, as plain functions of ``schemas/`` structs.

Every function here returns builtins (dicts, lists) the page's script renders with
``textContent``, never as HTML: a harness's output reaches the browser as data only.
Nothing here does I/O, so each page's content is tested without a server.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec
import orjson

from schemas import CompletionRecord, Trajectory
from schemas.completion import (
    REPLAY_DIVERGED,
    REPLAY_FAILED,
    REPLAY_REFUSED,
    REPLAYED,
    reconstruct_prompts,
)
from schemas.routing import RoutedExperts
from services.dashboard import toolparse
from services.dashboard.index import (
    ENDED,
    FAILED,
    STATES,
    Page,
    SessionIndex,
    SessionRow,
    cause,
    plain,
)

Decode = Callable[[int], str]  # one token id -> its text
MAX_TEXT = 200_000  # characters of one request/response/log shown; the rest is cut, said so


def kib(nbytes: int) -> str:
    return f"{nbytes / 1024:,.1f} KiB"


def clip(text: str, limit: int = MAX_TEXT) -> dict[str, Any]:
    if len(text) <= limit:
        return {"text": text, "cut": 0}
    return {"text": text[:limit], "cut": len(text) - limit}


def pretty(raw: msgspec.Raw | bytes | None) -> str:
    """A stored JSON value, indented (or as stored when it is not JSON)."""
    data = bytes(raw) if raw is not None else b"null"
    try:
        return orjson.dumps(orjson.loads(data), option=orjson.OPT_INDENT_2).decode()
    except orjson.JSONDecodeError:
        return data.decode("utf-8", "replace")


# -- overview -------------------------------------------------------------------------
def task_summary(task_id: str, rows: list[SessionRow], submitted_at: float) -> dict[str, Any]:
    counts = {s: n for s in STATES if (n := sum(1 for r in rows if r.state == s))}
    rewards = [r.reward for r in rows if r.reward is not None]
    done = sum(counts.get(s, 0) for s in ("COMPLETED", "TIMEOUT", "ERROR", "CANCELLED"))
    return {
        "task_id": task_id,
        "sessions": len(rows),
        "done": done,
        "counts": counts,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "harness": rows[0].harness if rows else None,
        "submitted_at": submitted_at,
        "live": done < len(rows),
        # nothing more will change: every session ended and its final record was read
        "settled": done == len(rows) and all(r.synced for r in rows),
    }


def task_page(index: SessionIndex, offset: int, limit: int) -> dict[str, Any]:
    """Tasks, live ones first, then the most recently submitted."""
    ids = sorted(
        index.tasks,
        key=lambda t: (
            not any(r.state not in ENDED for r in index.task_rows(t)),
            -index.submitted.get(t, 0.0),
        ),
    )
    page = ids[offset : offset + limit]
    return {
        "total": len(ids),
        "offset": offset,
        "limit": limit,
        "rows": [task_summary(t, index.task_rows(t), index.submitted.get(t, 0.0)) for t in page],
    }


def node_occupancy(nodes: Iterable[Any]) -> list[dict[str, Any]]:
    """Per node: each stage's use against its bound (from the pool's and executor's
    heartbeats, ``services/cli/status.py``'s rows)."""
    out: dict[str, dict[str, Any]] = {}
    for n in nodes:
        row = out.setdefault(n.node, {"node": n.node, "stages": {}, "age_seconds": None})
        for stage, used in n.stages.items():
            row["stages"][stage] = {"used": used, "bound": n.capacity.get(stage)}
        if n.age_seconds is not None:
            row["age_seconds"] = max(row["age_seconds"] or 0.0, n.age_seconds)
    return [out[k] for k in sorted(out)]


def overview(
    index: SessionIndex,
    *,
    now: float,
    nodes: list[Any] | None,
    streams: list[Any] | None,
    engines: list[dict[str, Any]],
    backpressure: bool | None,
    tasks: dict[str, Any],
) -> dict[str, Any]:
    rewards = [r.reward for r in index.rows.values() if r.reward is not None]
    return {
        "sessions": len(index.rows),
        "states": index.state_counts(),
        "sessions_per_second": round(index.sessions_per_second(now), 3),
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "rewarded": len(rewards),
        "tasks": tasks,
        "nodes": node_occupancy(nodes) if nodes is not None else None,
        "engines": engines,
        "backpressure": backpressure,
        "streams": [msgspec.to_builtins(s) for s in streams] if streams is not None else None,
        "errors": [{"reason": r, "count": n} for r, n in index.errors_by_reason()],
    }


def sessions_page(page: Page) -> dict[str, Any]:
    """A page of the sessions table: each row with why it ended as it did (``cause``)."""
    rows = [{**msgspec.to_builtins(r), "cause": cause(r)} for r in page.rows]
    return {"total": page.total, "offset": page.offset, "limit": page.limit, "rows": rows}


# -- task -----------------------------------------------------------------------------
PHASE_OF = {  # the states a timeline bar colours, each a phase
    "REGISTERED": "queued",
    "INITIALIZING": "init",
    "READY": "ready",
    "RUNNING": "running",
    "POSTRUN": "postrun",
    "BUILDING": "building",
    "EVALUATING": "evaluating",
}


def timeline(row: SessionRow, now: float) -> list[dict[str, Any]]:
    """The session's phases as [start, end) spans: each state from its entry to the next
    state's entry; the last live one runs to ``now``."""
    entered = sorted(row.entered.items(), key=lambda kv: kv[1])
    spans = []
    for i, (state, start) in enumerate(entered):
        if state in ENDED:
            break
        end = entered[i + 1][1] if i + 1 < len(entered) else now
        spans.append(
            {
                "state": state,
                "phase": PHASE_OF.get(state, state.lower()),
                "start": start,
                "end": end,
                "seconds": round(end - start, 3),
            }
        )
    return spans


TICKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900)
TICKS += (1800, 3600, 7200, 14400, 43200, 86400)


def axis(span: float, most: int = 8) -> list[dict[str, Any]]:
    """The timeline's time axis over ``span`` seconds: ticks at a round step (at most
    ``most`` + 1 of them), each as its offset from the start and a label."""
    day = TICKS[-1]
    step = next((t for t in TICKS if span / t <= most), day * math.ceil(span / (day * most)))
    n = int(span / step + 1e-9)  # float steps: 0.3 / 0.1 is 2.9999...
    return [{"at": k * step, "label": duration(k * step)} for k in range(n + 1)]


def duration(seconds: float) -> str:
    """``0``, ``200 ms``, ``45 s``, ``2 min``, ``1 h 30``: a tick's label."""
    if 0 < seconds < 1:
        return f"{round(seconds * 1000)} ms"
    s = int(round(seconds))
    if s == 0:
        return "0"
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min" + (f" {s % 60} s" if s % 60 else "")
    return f"{s // 3600} h" + (f" {s % 3600 // 60:02d}" if s % 3600 else "")


def group_member(row: SessionRow, traj: Trajectory | None) -> dict[str, Any]:
    """One GRPO group member, side by side with the others."""
    main = [t for t in traj.traces if not t.side_call] if traj else []
    return {
        "session_id": row.session_id,
        "index": row.index,
        "state": row.state,
        "outcome": row.outcome,
        "reward": row.reward,
        "length": sum(len(t.response_ids) for t in main) if traj else None,
        "sampled_tokens": traj.stats.sampled_tokens if traj else None,
        "turns": traj.stats.completions if traj else None,
        "chains": len(main) if traj else None,
        "reason": cause(row),
        "tool_parse": toolparse.of_built(traj),
    }


def task_view(
    task_id: str,
    spec: Any,
    rows: list[SessionRow],
    trajectories: Mapping[str, Trajectory | None],
    submitted_at: float,
    now: float,
) -> dict[str, Any]:
    members = [group_member(r, trajectories.get(r.session_id)) for r in rows]
    rewards = [m["reward"] for m in members if m["reward"] is not None]
    starts = [min(r.entered.values()) for r in rows if r.entered]
    summary = task_summary(task_id, rows, submitted_at)
    timelines = [
        {"session_id": r.session_id, "state": r.state, "spans": timeline(r, now)} for r in rows
    ]
    t0 = min(starts) if starts else now
    # a finished task is drawn over its own span, not up to now: its sessions would
    # shrink to slivers as time passed
    ends = [s["end"] for tl in timelines for s in tl["spans"]]
    t1 = now if summary["live"] or not ends else max(ends)
    return {
        **summary,
        "instruction": clip(spec.instruction, 4000) if spec else None,
        "num_samples": spec.num_samples if spec else len(rows),
        "builder": spec.builder.name if spec else None,
        "evaluator": spec.evaluator.name if spec else None,
        "timeline_start": t0,
        "timeline_end": max(t1, t0 + 0.001),
        "axis": axis(max(t1 - t0, 0.001)),
        "now": now,
        "timelines": timelines,
        "group": members,
        "tool_parse": toolparse.of_task(members),
        # a group whose rewards are all equal has no advantage to learn from
        "no_variance": len(rewards) > 1 and max(rewards) == min(rewards),
    }


# -- session --------------------------------------------------------------------------
def _ms(a: float, b: float) -> float | None:
    return round((b - a) * 1000, 2) if a and b else None


def _json(raw: msgspec.Raw) -> Any:
    try:
        return orjson.loads(bytes(raw))
    except orjson.JSONDecodeError:
        return None


def tool_calls_of(rec: CompletionRecord) -> list[dict[str, Any]]:
    reply = _json(rec.reply) or {}
    out = []
    for c in reply.get("tool_calls") or [] if isinstance(reply, dict) else []:
        fn = c.get("function") or {}
        out.append({"id": c.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments")})
    return out


def tool_results_of(rec: CompletionRecord) -> list[dict[str, Any]]:
    """The tool results this call's request carried (the OpenAI-shaped conversation)."""
    conv = _json(rec.normalized)
    messages = conv.get("messages") if isinstance(conv, dict) else None
    out = []
    for m in messages or []:
        if isinstance(m, dict) and m.get("role") == "tool":
            content = m.get("content")
            text = content if isinstance(content, str) else orjson.dumps(content).decode()
            out.append({"tool_call_id": m.get("tool_call_id"), "content": clip(text, 20_000)})
    return out


def routing_of_call(r: RoutedExperts | None) -> dict[str, Any] | None:
    """How much MoE routing (R3) a call carried: only the rows new to the session (the
    rest are its base record's), so a long conversation's later calls stay small."""
    if r is None:
        return None
    if r.base_seq is not None:
        whence = f" (delta from #{r.base_seq})"
    elif r.start:
        whence = f" (from position {r.start:,}: none before)"
    else:
        whence = ""
    return {
        "rows": r.rows,
        "start": r.start,
        "base_seq": r.base_seq,
        "nbytes": r.nbytes,
        "line": f"{r.rows:,} rows · {kib(r.nbytes)}{whence}",
    }


_REPLAY_LINES = {  # what the session page says of a replay's refused call
    REPLAY_DIVERGED: "diverged",
    REPLAY_REFUSED: "refused (diverged earlier)",
    REPLAY_FAILED: "replayed failure",
}


def replay_of_call(rec: CompletionRecord) -> dict[str, Any] | None:
    """What a replay (``polar replay``, docs/replay.md) did with this call (its record's
    ``ReplayMark``): answered it from the recorded call ``seq`` of ``session_id``,
    diverged there, refused it after diverging, or replayed the recorded call's failure;
    None for a live call."""
    m = rec.replay
    if m is None:
        return None
    if m.result != REPLAYED:
        kind = "failure" if m.result == REPLAY_FAILED else m.result
        return {"kind": kind, "session_id": m.session_id, "line": _REPLAY_LINES[m.result]}
    line = f"replayed #{m.seq} of {m.session_id}"
    if m.nondeterministic:
        line += f" · nondeterministic: {', '.join(m.nondeterministic)}"
    return {
        "kind": "replayed",
        "session_id": m.session_id,
        "attempt": m.attempt,
        "seq": m.seq,
        "nondeterministic": list(m.nondeterministic),
        "trainable": m.trainable,
        "line": line,
    }


def replay_summary(records: Iterable[CompletionRecord]) -> dict[str, Any] | None:
    """A replay session's one line: the recorded session, how many calls were answered
    from it, how many went to the engine, and the call it diverged at (None: it did not);
    None for a session that is no replay (no call replayed, none diverged)."""
    recorded: str | None = None
    replayed = live = 0
    diverged_at: int | None = None
    for rec in records:
        m = rec.replay
        if m is not None:
            recorded = recorded or m.session_id
            replayed += m.result == REPLAYED
            if m.result == REPLAY_DIVERGED:  # the replay's own call number (never retried)
                diverged_at = rec.seq if diverged_at is None else min(diverged_at, rec.seq)
        elif not rec.void and rec.side_call != "judge":  # an evaluator's call is its own
            live += 1
    if recorded is None:
        return None
    line = (
        f"replay of {recorded}: {replayed} call{'' if replayed == 1 else 's'} replayed, {live} live"
    )
    if diverged_at is not None:
        line += f", diverged at call {diverged_at}"
    return {
        "of": recorded,
        "replayed": replayed,
        "live": live,
        "diverged_at": diverged_at,
        "line": line,
    }


def divergence(records: Iterable[CompletionRecord]) -> str | None:
    """Where a replay diverged and how (the call, the field, both sides): the report its
    diverged call's record keeps; None when it did not diverge."""
    diverged = [r for r in records if r.replay is not None and r.replay.result == REPLAY_DIVERGED]
    return min(diverged, key=lambda r: r.seq).error if diverged else None


def model_call(rec: CompletionRecord, prompt_len: int | None) -> dict[str, Any]:
    t = rec.timings
    engine_ms = _ms(t.upstream_start, t.upstream_end) if t else None
    whole_ms = _ms(t.received, t.captured) if t else None
    proxy_ms = round(whole_ms - engine_ms, 2) if whole_ms is not None and engine_ms else whole_ms
    return {
        "seq": rec.seq,
        "attempt": rec.attempt,
        "protocol": rec.protocol.value,
        "mode": rec.mode.value,
        "side_call": rec.side_call,
        "model": rec.model,
        "tokens_in": prompt_len,
        "tokens_out": len(rec.output_ids),
        "engine_ms": engine_ms,
        "proxy_ms": proxy_ms,
        "queue_ms": t.queue_ms if t else None,
        "weight_version": rec.weight_version,
        "weight_versions": list(rec.weight_versions),
        "extends_previous": rec.extends_previous,
        "drift_reason": rec.drift_reason,
        "finish_reason": rec.finish_reason,
        "error": rec.error,
        "aborted": rec.aborted,
        "user_agent": rec.user_agent,
        "request": clip(pretty(rec.raw_request)),
        "engine_request": clip(pretty(rec.normalized)),
        "reply": clip(pretty(rec.reply)),
        "tool_calls": tool_calls_of(rec),
        "tool_results": tool_results_of(rec),
        "tool_parse": toolparse.of_call(rec.tool_parse),
        "routing": routing_of_call(rec.routing),
        "replay": replay_of_call(rec),
    }


FAILURE_LINES = 40  # stderr lines the failure section shows (the whole tail is below)


def failure(row: SessionRow, artifacts: Any) -> dict[str, Any] | None:
    """Why a session that failed, timed out or was cancelled did (None for any other):
    the run's reason from the registry, the evaluator's, and the harness's exit code and
    the end of its stderr, from the artifacts (the list's copy when they are gone)."""
    if row.state not in FAILED and row.eval_status != "error":
        return None
    stderr = plain(artifacts.stderr_tail) if artifacts is not None else row.stderr or ""
    return {
        "state": row.state,
        "reason": row.reason,
        "eval_reason": row.eval_reason,
        "exit_code": artifacts.exit_code if artifacts is not None else row.exit_code,
        "stderr": "\n".join(stderr.rstrip().splitlines()[-FAILURE_LINES:]),
        "artifacts": artifacts is not None,
    }


def session_view(
    row: SessionRow,
    records: list[CompletionRecord],
    problems: list[str],
    artifacts: Any,
    trajectory: Trajectory | None,
    now: float,
) -> dict[str, Any]:
    try:
        prompts = reconstruct_prompts(records)
    except KeyError:
        prompts = {}
    calls = [
        model_call(r, len(p) if (p := prompts.get(r.seq)) is not None else None)
        for r in sorted(records, key=lambda r: r.seq)
    ]
    art = None
    if artifacts is not None:
        art = {
            "exit_code": artifacts.exit_code,
            "harness": artifacts.harness,
            "harness_version": artifacts.harness_version,
            "protocol": artifacts.protocol,
            "diff": clip(artifacts.diff),
            # a terminal's colours and progress bars, as the terminal showed them
            "stdout_tail": clip(plain(artifacts.stdout_tail)),
            "stderr_tail": clip(plain(artifacts.stderr_tail)),
            "logs": {name: clip(plain(text)) for name, text in sorted(artifacts.logs.items())},
            "files": {name: clip(text) for name, text in sorted(artifacts.files.items())},
        }
    return {
        "session": msgspec.to_builtins(row),
        "spans": timeline(row, now),
        "calls": calls,
        "tool_parse": toolparse.of_session(calls),
        # the calls' routing column: only an MoE engine's sessions have one
        "routing": any(c["routing"] is not None for c in calls),
        # a replay's session (``polar replay``): its line, and the calls' replay column
        "replay": replay_summary(records),
        "replay_column": any(c["replay"] is not None for c in calls),
        "problems": problems,
        "artifacts": art,
        # nothing more will change: ended, its final record read, its artifacts here
        "settled": row.state in ENDED and row.synced and artifacts is not None,
        "failure": failure(row, artifacts),
        "verdict": {
            "reward": row.reward,
            "eval_status": row.eval_status or (trajectory.eval_status if trajectory else None),
            "eval_reason": row.eval_reason or (trajectory.eval_reason if trajectory else None),
            "outcome": row.outcome,
            "reason": row.reason,
        },
        "trajectory": None
        if trajectory is None
        else {
            "builder": trajectory.builder,
            "intact": trajectory.intact,
            "stats": msgspec.to_builtins(trajectory.stats),
            "metadata": orjson.loads(orjson.dumps(trajectory.metadata, default=str)),
        },
    }
