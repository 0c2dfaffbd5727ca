"""The trajectory viewer: each trace as decoded tokens (loss mask, logprob, weight version
of each, whether it has MoE routing), its chain, break reason and lineage; ``stored``
(what the trainer got, else the builder's) or rebuilt from the session's records by the
builder's own code. Pure, as ``views``: the page's script puts every piece in as text.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from itertools import accumulate
from typing import Any

import msgspec

from schemas import BuilderSpec, CompletionRecord, Outcome, Trace, Trajectory
from schemas.routing import DTYPES
from services.builder.logic import run_builder
from services.builder.strategies import default_registry
from services.common.redact import REDACTED, Scrubber
from services.dashboard import toolparse
from services.dashboard.index import ENDED, SessionRow
from services.dashboard.views import Decode, clip, kib

VIEWS = ("stored", "per_request", "prefix_merging")  # the trajectory viewer's switch
MAX_TOKENS = 20_000  # response tokens of one trace sent to the viewer


def undelivered_note(row: SessionRow, built: Trajectory | None) -> str:
    """What the stored view says when no trainer has the trajectory (yet)."""
    if built is None:
        return "not built yet: showing nothing (pick a rebuilt view)"
    if row.state not in ENDED or not row.synced:
        return "not delivered yet: the builder's trajectory, before its evaluation (no reward)"
    return (
        "not on the trajectories stream (never delivered, or aged out of it): the builder's "
        "trajectory, before its evaluation (no reward)"
    )


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


def lineage(trace: Trace, traces: list[Trace]) -> dict[str, Any] | None:
    """The chain ``trace`` branched from, as the viewer names it. A side call made before
    the main loop began (a title, a router) is filed by the builder under the session's
    first chain, which started after it: shown as such, never as a chain it came from."""
    if trace.lineage_id is None:
        return None
    parent = next((t for t in traces if t.trace_id == trace.lineage_id), None)
    first = min(trace.completion_seqs, default=None)
    later = (
        parent is not None
        and first is not None
        and min(parent.completion_seqs, default=first) > first
    )
    return {
        "trace_id": trace.lineage_id,
        "chain_id": parent.chain_id if parent is not None else None,
        "later": later,  # the "parent" began after this trace: it came from no chain
    }


def routing_of(trace: Trace, shown: int) -> dict[str, Any]:
    """Where the trace has MoE routing (R3), from its segments alone (the rows stay in the
    object store): a summary line and the runs ``[start, end)`` of the first ``shown``
    response tokens that have it (the viewer's "routing" toggle marks the others)."""
    r = trace.routing
    if r is None:
        return {"line": "routing: none", "present": []}
    p = len(trace.prompt_ids)
    m = p + len(trace.response_ids)
    present = bytearray(m)  # segments may overlap or run past the end: count positions
    for s in r.segments:
        start, end = max(s.start, 0), min(s.start + s.length, m)
        if end > start:
            present[start:end] = b"\x01" * (end - start)
    n = present.count(1)
    line = (
        f"routing: {n:,} of {m:,} positions (prompt {present[:p].count(1):,} of {p:,}), "
        f"{r.layers} layers × top-k {r.top_k}, {r.dtype}, "
        f"{kib(n * r.layers * r.top_k * DTYPES[r.dtype])}"
    )
    runs = re.finditer(b"\x01+", bytes(present[p : p + shown]))
    return {"line": line, "present": [[g.start(), g.end()] for g in runs]}


def trace_view(
    trace: Trace,
    decode: Decode | None,
    scrub: Scrubber | None = None,
    traces: list[Trace] | None = None,
) -> dict[str, Any]:
    """One trace as tokens: text, loss mask, logprob and weight version of each response
    token, and which have MoE routing; the prompt as one decoded block. With ``scrub``,
    tokens that spell a secret show as one ``[redacted]`` and lose their ids."""
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
        "lineage": lineage(trace, traces or []),
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
        "routing": routing_of(trace, shown),
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
        "traces": [trace_view(t, decode, scrub, traces) for t in traces],
    }
