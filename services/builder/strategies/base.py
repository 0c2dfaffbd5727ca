"""What every trajectory builder shares.

A builder is any object with ``build(records, config, outcome)`` returning
``(traces, stats)`` or ``(traces, stats, notes)``: pure, no I/O, deterministic for the
same input (the service may rebuild after a crash and must get the same trajectory).
``notes`` (a dict) is merged into the trajectory's metadata.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec

from schemas import BuildStats, CompletionRecord, Outcome, Trace, VersionSpan
from schemas.completion import ToolParseFailure, reconstruct_prompts
from schemas.trajectory import ToolFailure, TraceToolParse, checked_calls

T = TypeVar("T")
CUT_FINISH_REASONS = frozenset({"abort", "error"})
EOT_FINISH_REASONS = frozenset({"stop", "tool_calls"})  # turns the model ended itself


class BuildError(ValueError):
    """A build that cannot run as asked (bad builder config, unknown builder)."""


class TrajectoryBuilder(Protocol):
    def build(
        self, records: list[CompletionRecord], config: dict[str, Any], outcome: Outcome
    ) -> tuple[list[Trace], BuildStats] | tuple[list[Trace], BuildStats, dict[str, Any]]: ...


@dataclass(frozen=True)
class Call:
    """One completion with its full prompt (records store prompts incrementally)."""

    rec: CompletionRecord
    prompt: list[int]

    @property
    def seq(self) -> int:
        return self.rec.seq

    @property
    def output(self) -> list[int]:
        return self.rec.output_ids

    @property
    def cut(self) -> bool:
        """Aborted or errored: the turn did not end normally."""
        r = self.rec
        return r.aborted or r.error is not None or r.finish_reason in CUT_FINISH_REASONS


@dataclass(frozen=True)
class Calls:
    calls: list[Call]  # in seq order, one per seq
    unreconstructable: list[int]  # seqs whose base record is missing
    duplicates: list[int]  # seqs seen more than once (the first copy is kept)
    void: list[int] = field(default_factory=list)  # seqs of calls that failed unsampled


def full_calls(records: Iterable[CompletionRecord]) -> Calls:
    """Full prompts for every record; a record whose base is missing is set aside."""
    by_seq: dict[int, CompletionRecord] = {}
    duplicates = []
    for rec in records:
        if rec.seq in by_seq:
            duplicates.append(rec.seq)
        else:
            by_seq[rec.seq] = rec
    missing: list[int] = []
    prompts = reconstruct_prompts(by_seq.values(), missing)
    calls = [Call(by_seq[seq], prompts[seq]) for seq in sorted(prompts)]
    void = [seq for seq in sorted(by_seq) if by_seq[seq].void]
    return Calls(calls, missing, sorted(set(duplicates)), void)


def parse_config(config: dict[str, Any], cls: type[T], builder: str) -> T:
    """A builder's typed config; unknown keys and wrong types are errors that say how to fix."""
    try:
        return msgspec.convert(config or {}, cls)
    except msgspec.ValidationError as exc:
        fields = ", ".join(cls.__struct_fields__) or "none"  # type: ignore[attr-defined]
        raise BuildError(
            f"builder {builder!r}: bad config ({exc}); accepted keys: {fields}"
        ) from None


def detect_eot(calls: Sequence[Call]) -> int | None:
    """The most common last output token of turns the model ended itself, if any."""
    last = Counter(
        c.output[-1] for c in calls if c.output and c.rec.finish_reason in EOT_FINISH_REASONS
    )
    if not last:
        return None
    return min(last.items(), key=lambda kv: (-kv[1], kv[0]))[0]  # ties: the lowest id


def starts_with(seq: list[int], prefix: list[int]) -> bool:
    return len(seq) >= len(prefix) and seq[: len(prefix)] == prefix


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect on slices (C-speed compares)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def output_logprobs(rec: CompletionRecord) -> list[float | None]:
    """One logprob per output token, None where the backend reported none (and on a
    replayed call's, which the loss mask leaves out: ``sampled_mask``)."""
    if len(rec.output_logprobs) == len(rec.output_ids) and sampled_mask(rec):
        return list(rec.output_logprobs)
    return [None] * len(rec.output_ids)


def sampled_mask(rec: CompletionRecord) -> int:
    """The loss mask of a call's output: 1, but 0 for a replayed call's (its tokens are a
    recorded call's, answered again: ``polar replay``) unless the replay asked to train."""
    return 0 if rec.replay is not None and not rec.replay.trainable else 1


def trace_id(session_id: str, chain_id: int) -> str:
    return f"{session_id}/{chain_id}"


def weight_versions(calls: Iterable[Call]) -> list[str]:
    """The distinct versions that sampled these calls, in order (a swap mid-call: all)."""
    seen: dict[str, None] = {}
    for c in calls:
        for v in c.rec.weight_versions or ([c.rec.weight_version] if c.rec.weight_version else []):
            seen.setdefault(v)
    return list(seen)


def version_spans(rec: CompletionRecord, offset: int) -> list[VersionSpan]:
    """Which weights sampled which of ``rec``'s output tokens, as spans of the trace's
    response (``rec``'s output starts at ``offset`` there). A swap mid-call gives one span
    per version; an engine that names no version gives none."""
    n = len(rec.output_ids)
    if not sampled_mask(rec):  # spans never cover a masked token
        return []
    if rec.weight_versions:
        ends = [*rec.weight_version_starts[1:], n]
        pairs = zip(rec.weight_versions, rec.weight_version_starts, ends, strict=True)
    elif rec.weight_version is not None:
        pairs = [(rec.weight_version, 0, n)]
    else:
        return []
    return [VersionSpan(version=v, start=offset + a, end=offset + b) for v, a, b in pairs if b > a]


def stats_of(calls: Sequence[Call], traces: Sequence[Trace], breaks: dict[str, int]) -> BuildStats:
    """What a trainer processes for these traces, against one trace per completion."""
    built = sum(len(t.prompt_ids) + len(t.response_ids) for t in traces)
    per_request = sum(len(c.prompt) + len(c.output) for c in calls)
    return BuildStats(
        completions=len(calls),
        chains=len(traces),
        tokens=built,
        sampled_tokens=sum(len(c.output) for c in calls),
        merge_ratio=round(per_request / built, 4) if built else 1.0,
        breaks=breaks,
        **tool_counts(c.rec for c in calls),
    )


def tool_counts(records: Iterable[CompletionRecord]) -> dict[str, Any]:
    """``BuildStats``' tool-call parse counts of these records."""
    turns = checked = 0
    failed: Counter[str] = Counter()
    for rec in records:
        if rec.tool_parse is not None:
            turns += 1
            checked += checked_calls(rec.tool_parse)
            failed.update(f.kind for f in rec.tool_parse.failures)
    return {"tool_turns": turns, "tool_calls_checked": checked, "tool_calls_failed": dict(failed)}


MAX_FAILURE_DETAIL = 200  # characters of a failure's detail a trace keeps (the record: all)


def tool_parse_of(placed: Iterable[tuple[CompletionRecord, int]]) -> TraceToolParse | None:
    """The tool-call parse health of a trace's calls, given each with the index of
    ``response_ids`` its output starts at; None when none of them offered tools."""
    turns = checked = 0
    family = ""
    failures: list[ToolFailure] = []
    for rec, offset in placed:
        parse = rec.tool_parse
        if parse is None:
            continue
        turns += 1
        checked += checked_calls(parse)
        family = family or parse.family
        failures += [placed_failure(f, rec, offset) for f in parse.failures]
    if not turns:
        return None
    return TraceToolParse(family=family, turns=turns, checked=checked, failures=failures)


def placed_failure(f: ToolParseFailure, rec: CompletionRecord, offset: int) -> ToolFailure:
    """``f`` (token offsets into ``rec``'s output) at its span of a trace whose response
    holds that output from ``offset`` on; a span that is not a piece of the output (-1, or
    out of range) stays whole-call."""
    start, end = -1, -1
    if 0 <= f.start < f.end <= len(rec.output_ids):
        start, end = offset + f.start, offset + f.end
    detail = (
        f.detail if len(f.detail) <= MAX_FAILURE_DETAIL else f.detail[:MAX_FAILURE_DETAIL] + "…"
    )
    return ToolFailure(seq=rec.seq, kind=f.kind, detail=detail, start=start, end=end)


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [m for m in value if isinstance(m, dict)] if isinstance(value, list) else []


def _json(raw: msgspec.Raw) -> Any:
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None


def conversation_of(rec: CompletionRecord) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(messages, tools)`` of a call as the proxy recorded them: the request's messages
    followed by the assistant turn the proxy answered with (when it recorded one), so the
    last call of a trace gives the whole conversation."""
    conv = _json(rec.normalized)
    conv = conv if isinstance(conv, dict) else {}
    messages, tools = _dicts(conv.get("messages")), _dicts(conv.get("tools"))
    reply = _json(rec.reply)
    if isinstance(reply, dict):
        messages.append(reply)
    return messages, tools
