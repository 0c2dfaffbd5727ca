"""What each dashboard page shows, as plain functions of ``schemas/`` structs.

Every function here returns builtins (dicts, lists) the page's script renders with
``textContent``, never as HTML: a harness's output reaches the browser as data only.
Nothing here does I/O, so each page's content is tested without a server.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping
from itertools import accumulate
from typing import Any

import msgspec
import orjson

from schemas import BuilderSpec, CompletionRecord, Outcome, Trace, Trajectory
from schemas.completion import reconstruct_prompts
from services.builder.logic import run_builder
from services.builder.strategies import default_registry
from services.common.redact import REDACTED, Scrubber
from services.dashboard import toolparse
from services.dashboard.index import STATES, SessionIndex, SessionRow

Decode = Callable[[int], str]  # one token id -> its text
VIEWS = ("stored", "per_request", "prefix_merging")  # the trajectory viewer's switch
MAX_TEXT = 200_000  # characters of one request/response/log shown; the rest is cut, said so
MAX_TOKENS = 20_000  # response tokens of one trace sent to the viewer


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
            not any(r.state not in _ENDED for r in index.task_rows(t)),
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


_ENDED = frozenset({"COMPLETED", "TIMEOUT", "ERROR", "CANCELLED"})


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
        if state in _ENDED:
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
        "reason": row.eval_reason or row.reason,
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
    return {
        **task_summary(task_id, rows, submitted_at),
        "instruction": clip(spec.instruction, 4000) if spec else None,
        "num_samples": spec.num_samples if spec else len(rows),
        "builder": spec.builder.name if spec else None,
        "evaluator": spec.evaluator.name if spec else None,
        "timeline_start": min(starts) if starts else now,
        "now": now,
        "timelines": [
            {"session_id": r.session_id, "state": r.state, "spans": timeline(r, now)} for r in rows
        ],
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
            "stdout_tail": clip(artifacts.stdout_tail),
            "stderr_tail": clip(artifacts.stderr_tail),
            "logs": {name: clip(text) for name, text in sorted(artifacts.logs.items())},
            "files": {name: clip(text) for name, text in sorted(artifacts.files.items())},
        }
    return {
        "session": msgspec.to_builtins(row),
        "spans": timeline(row, now),
        "calls": calls,
        "tool_parse": toolparse.of_session(calls),
        "problems": problems,
        "artifacts": art,
        # nothing more will change: ended, its final record read, its artifacts here
        "settled": row.state in _ENDED and row.synced and artifacts is not None,
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


# -- trajectory viewer ----------------------------------------------------------------
def rebuild(records: list[CompletionRecord], builder: str, outcome: Outcome) -> list[Trace]:
    """The traces the named builder makes of the session's records (the builder's own
    code: the viewer's per_request / prefix_merging switch)."""
    built = run_builder(default_registry(), BuilderSpec(name=builder), records, outcome)
    return built.traces


def hidden_pieces(pieces: list[str], scrub: Scrubber) -> set[int]:
    """Which pieces (decoded tokens) hold part of a secret: a token the model echoed is
    cut into many, none of which a scan of one piece would catch."""
    spans = scrub.spans("".join(pieces))
    starts = list(accumulate((len(p) for p in pieces), initial=0))
    hidden: set[int] = set()
    for start, end in spans:
        i = max(bisect_right(starts, start) - 1, 0)
        while i < len(pieces) and starts[i] < end:
            hidden.add(i)
            i += 1
    return hidden


def trace_view(
    trace: Trace, decode: Decode | None, scrub: Scrubber | None = None
) -> dict[str, Any]:
    """One trace as tokens: text, loss mask, logprob and weight version of each response
    token; the prompt as one decoded block. With ``scrub``, tokens that spell a secret
    show as one ``[redacted]`` and lose their ids."""
    n = len(trace.response_ids)
    shown = min(n, MAX_TOKENS)
    versions = trace.token_versions()
    ids: list[int | None] = list(trace.response_ids[:shown])
    pieces = [decode(tid) if decode else str(tid) for tid in ids]
    if decode and scrub is not None:
        hidden = hidden_pieces(pieces, scrub)
        for i in sorted(hidden):
            pieces[i], ids[i] = ("" if i - 1 in hidden else REDACTED), None
    tokens = [
        [pieces[i], trace.loss_mask[i], trace.response_logprobs[i], versions[i], tid]
        for i, tid in enumerate(ids)
    ]
    prompt = (
        "".join(decode(t) for t in trace.prompt_ids)
        if decode
        else " ".join(map(str, trace.prompt_ids))
    )
    return {
        "trace_id": trace.trace_id,
        "chain_id": trace.chain_id,
        "lineage_id": trace.lineage_id,
        "break_reason": trace.break_reason,
        "side_call": trace.side_call,
        "trainable": trace.trainable,
        "reward": trace.reward,
        "completion_seqs": list(trace.completion_seqs),
        "prompt_tokens": len(trace.prompt_ids),
        "prompt": clip(prompt, 100_000),
        "response_tokens": n,
        "sampled_tokens": sum(trace.loss_mask),
        "tokens": tokens,  # [text, mask, logprob, version, id]
        "tokens_cut": n - shown,
        "version_spans": [msgspec.to_builtins(s) for s in trace.version_spans],
        "tool_parse": toolparse.of_trace(trace.tool_parse),
    }


def trajectory_view(
    session_id: str,
    view: str,
    traces: list[Trace],
    decode: Decode | None,
    note: str | None,
    scrub: Scrubber | None = None,
) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "view": view,
        "views": list(VIEWS),
        "note": note,
        "decoded": decode is not None,
        "traces": [trace_view(t, decode, scrub) for t in traces],
    }


# -- training -------------------------------------------------------------------------
def training_view(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Curves by step from the trainer's JSONL log (``services/trainer/metrics.py``);
    by step, the last record wins (a step redone after a restart)."""
    steps: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for r in records:
        kind, step = r.get("type"), r.get("step")
        if not isinstance(step, int):
            continue
        if kind == "step":
            steps[step] = r
        elif kind == "eval":
            evals[step] = r

    def series(rows: dict[int, dict[str, Any]], value: Callable[[dict[str, Any]], Any]):
        return [[s, v] for s in sorted(rows) if isinstance(v := value(rows[s]), int | float)]

    return {
        "steps": len(steps),
        "curves": {
            "reward": series(steps, lambda r: r.get("reward_mean")),
            "heldout_accuracy": series(evals, lambda r: r.get("accuracy")),
            "loss": series(steps, lambda r: r.get("loss")),
            "staleness": series(steps, lambda r: mean_staleness(r.get("staleness") or {})),
            "mismatch": series(steps, lambda r: r.get("mismatch_max")),
        },
    }


def mean_staleness(ages: Mapping[str, Any]) -> float | None:
    """Mean age (trainer version minus the sampling version) of a step's samples."""
    total = n = 0.0
    for age, count in ages.items():
        try:
            total += float(age) * float(count)
            n += float(count)
        except (TypeError, ValueError):
            continue
    return total / n if n else None


def parse_jsonl(lines: Iterable[bytes]) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a line being written right now
        if isinstance(rec, dict):
            out.append(rec)
    return out
