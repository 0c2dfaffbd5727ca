"""A chain: completions whose prompts extend one another, kept as one growing trace.

The chain's tokens are always its latest prompt + that call's output. A call joins by
extending them; what lies between the previous output and the new output (tool results,
template glue, the generation prompt) gets loss mask 0 and no logprob.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from schemas import Trace, VersionSpan
from services.builder.strategies.base import (
    Call,
    conversation_of,
    output_logprobs,
    sampled_mask,
    starts_with,
    tool_parse_of,
    trace_id,
    version_spans,
    weight_versions,
)
from services.builder.strategies.routing import routing_of


@dataclass
class Chain:
    chain_id: int
    reason: str  # why this chain is not part of an earlier one
    parent: Chain | None  # the chain it branched from (lineage)
    calls: list[Call]
    tokens: list[int]  # latest prompt + latest output
    mask: list[int]  # over tokens after the first prompt
    logprobs: list[float | None]
    spans: list[VersionSpan]  # which weights sampled which response tokens
    closed: bool = False  # no call may extend it (a cut turn, a side call)
    glue_closed: list[tuple[int, str]] = field(default_factory=list)  # (seq, finish reason)
    tag: str | None = None  # a side-call tag the builder found (the proxy's, if None)
    retagged_from: str | None = None  # the reason it had before the builder retagged it

    @classmethod
    def start(cls, chain_id: int, call: Call, reason: str, parent: Chain | None) -> Chain:
        return cls(
            chain_id=chain_id,
            reason=reason,
            parent=parent,
            calls=[call],
            tokens=call.prompt + call.output,
            mask=[sampled_mask(call.rec)] * len(call.output),
            logprobs=output_logprobs(call.rec),
            spans=version_spans(call.rec, 0),
            closed=call.cut or call.rec.side_call is not None,
        )

    @property
    def first(self) -> Call:
        return self.calls[0]

    @property
    def tip(self) -> Call:
        return self.calls[-1]

    @property
    def side_call(self) -> str | None:
        return self.tag or self.first.rec.side_call

    def retag(self, tag: str, parent: Chain | None) -> None:
        """A side call the builder recognised (e.g. a compaction's summarization call)."""
        self.retagged_from = self.reason
        self.reason, self.tag, self.parent, self.closed = f"side_call:{tag}", tag, parent, True

    def takes(self, call: Call) -> bool:
        """``call`` continues this chain: its prompt extends the tip's prompt + output.

        The prompt must be longer than the tip's prompt, so a retry of the same prompt
        never joins; it may equal the tip's prompt + output (a continuation with no glue).
        Image tokens are alike whatever the image: the tip's images must be the call's
        first ones, at the same places.
        """
        seen = self.tip.rec.images
        return (
            not self.closed
            and len(call.prompt) > len(self.tip.prompt)
            and starts_with(call.prompt, self.tokens)
            and call.rec.images[: len(seen)] == seen
        )

    def append(self, call: Call, eot: int | None) -> None:
        glue = call.prompt[len(self.tokens) :]
        self._note_glue_eot(glue, eot)
        self.tokens.extend(glue)
        self.spans.extend(version_spans(call.rec, len(self.tokens) - len(self.first.prompt)))
        self.tokens.extend(call.output)
        self.mask.extend([0] * len(glue))
        self.mask.extend([sampled_mask(call.rec)] * len(call.output))
        self.logprobs.extend([None] * len(glue))
        self.logprobs.extend(output_logprobs(call.rec))
        self.calls.append(call)
        self.closed = call.cut

    def _note_glue_eot(self, glue: list[int], eot: int | None) -> None:
        # A turn without its own end-of-turn (length-truncated, or a stop the engine did
        # not report) is closed by the next prompt's eot: that token is glue, never the
        # model's, so it keeps mask 0 and no logprob.
        out = self.tip.output
        if eot is not None and glue[:1] == [eot] and (not out or out[-1] != eot):
            self.glue_closed.append((self.tip.seq, self.tip.rec.finish_reason))

    def to_trace(self, session_id: str, calls: Mapping[int, Call]) -> Trace:
        n = len(self.first.prompt)
        messages, tools = conversation_of(self.tip.rec)
        return Trace(
            trace_id=trace_id(session_id, self.chain_id),
            chain_id=self.chain_id,
            lineage_id=trace_id(session_id, self.parent.chain_id) if self.parent else None,
            break_reason=self.reason,
            prompt_ids=self.tokens[:n],
            response_ids=self.tokens[n:],
            loss_mask=list(self.mask),
            response_logprobs=list(self.logprobs),
            messages=messages,
            tools=tools,
            weight_versions=weight_versions(self.calls),
            version_spans=list(self.spans),
            completion_seqs=[c.seq for c in self.calls],
            images=list(self.tip.rec.images),  # the latest prompt holds every earlier one
            side_call=self.side_call,
            trainable=any(self.mask),
            # a call's output sits right after its prompt, which holds the chain so far
            tool_parse=tool_parse_of((c.rec, len(c.prompt) - n) for c in self.calls),
            # the chain's tokens are its tip's prompt + output: so are its positions
            routing=routing_of(self.tip, calls),
        )
