"""per_request: one trace per completion, loss mask 1 on every sampled token."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from msgspec import Struct

from schemas import BuildStats, CompletionRecord, Outcome, Trace
from services.builder.strategies.base import (
    Call,
    conversation_of,
    full_calls,
    output_logprobs,
    parse_config,
    sampled_mask,
    stats_of,
    tool_parse_of,
    trace_id,
    version_spans,
    weight_versions,
)
from services.builder.strategies.routing import routing_of


class PerRequestConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


def trace_of(call: Call, chain_id: int, calls: Mapping[int, Call]) -> Trace:
    rec = call.rec
    messages, tools = conversation_of(rec)
    return Trace(
        trace_id=trace_id(rec.session_id, chain_id),
        chain_id=chain_id,
        break_reason=f"side_call:{rec.side_call}" if rec.side_call else None,
        prompt_ids=call.prompt,
        response_ids=list(rec.output_ids),
        loss_mask=[sampled_mask(rec)] * len(rec.output_ids),
        response_logprobs=output_logprobs(rec),
        messages=messages,
        tools=tools,
        weight_versions=weight_versions([call]),
        version_spans=version_spans(rec, 0),
        completion_seqs=[rec.seq],
        images=list(rec.images),
        side_call=rec.side_call,
        trainable=bool(rec.output_ids) and bool(sampled_mask(rec)),
        tool_parse=tool_parse_of([(rec, 0)]),
        routing=routing_of(call, calls),
    )


class PerRequest:
    name = "per_request"

    def build(
        self, records: list[CompletionRecord], config: dict[str, Any], outcome: Outcome
    ) -> tuple[list[Trace], BuildStats]:
        parse_config(config, PerRequestConfig, self.name)
        calls = full_calls(records).calls
        by_seq = {c.seq: c for c in calls}
        traces = [trace_of(c, i, by_seq) for i, c in enumerate(calls)]
        breaks: dict[str, int] = {}
        for t in traces:
            if t.break_reason:
                breaks[t.break_reason] = breaks.get(t.break_reason, 0) + 1
        return traces, stats_of(calls, traces, breaks)
