"""What a trainer reads off a Trace beyond tokens: which weights sampled which response
token (``version_spans``, ``token_versions()``) and the whole conversation (``messages``
ending with the last sampled turn, ``tools``)."""

from __future__ import annotations

import msgspec
import pytest

from schemas import Outcome, Trace, VersionSpan, decode, encode
from services.builder.strategies.per_request import PerRequest
from services.builder.strategies.prefix_merging import PrefixMerging
from tests.unit.builder.synth import EOT, Capture, glue_after, opening

TOOLS = [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object"}}}]
USER = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count"}]


def conv(messages: list[dict]) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode({"messages": messages, "tools": TOOLS}))


def reply(text: str) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode({"role": "assistant", "content": text}))


def two_turns(cap: Capture) -> None:
    """Turn 1 sampled by v1; turn 2 by v1 then v2 (a swap mid-call at output token 2)."""
    p0 = opening([100, 101], [200])
    o0 = [300, 301, EOT]
    cap.call(p0, o0, weight_version="v1", normalized=conv(USER), reply=reply("ls"))
    p1 = p0 + o0 + glue_after(o0, [400, 401])
    o1 = [500, 501, 502, 503, EOT]
    history = [*USER, {"role": "assistant", "content": "ls"}, {"role": "tool", "content": "a b"}]
    cap.call(
        p1,
        o1,
        finish="stop",
        weight_version="v2",
        weight_versions=["v1", "v2"],
        weight_version_starts=[0, 2],
        normalized=conv(history),
        reply=reply("2"),
    )


def build(builder, cap: Capture) -> list[Trace]:
    out = builder.build(cap.records, {}, Outcome.COMPLETED)
    return [decode(encode(t), Trace) for t in out[0]]  # as a trainer receives them


def test_prefix_merged_trace_spans_each_version_over_sampled_tokens_only():
    cap = Capture()
    two_turns(cap)
    (trace,) = build(PrefixMerging(), cap)
    mask = trace.loss_mask
    first, second = mask.index(1), len(mask) - 5  # turn 2 is the last 5 tokens
    assert trace.version_spans == [
        VersionSpan(version="v1", start=0, end=3),
        VersionSpan(version="v1", start=second, end=second + 2),
        VersionSpan(version="v2", start=second + 2, end=second + 5),
    ]
    assert first == 0
    versions = trace.token_versions()
    assert len(versions) == len(trace.response_ids)
    # every sampled token has its version; no masked token has one
    assert all((v is not None) == bool(m) for v, m in zip(versions, mask, strict=True))
    assert versions[-3:] == ["v2"] * 3 and versions[:3] == ["v1"] * 3
    assert trace.weight_versions == ["v1", "v2"]


def test_per_request_traces_span_their_own_output():
    cap = Capture()
    two_turns(cap)
    t0, t1 = build(PerRequest(), cap)
    assert t0.version_spans == [VersionSpan(version="v1", start=0, end=3)]
    assert t1.token_versions() == ["v1", "v1", "v2", "v2", "v2"]
    assert t1.weight_versions == ["v1", "v2"]  # the swap's first version is not lost


def test_no_version_reported_gives_no_spans():
    cap = Capture()
    cap.call(opening([100], [200]), [300, EOT], weight_version=None)
    (trace,) = build(PrefixMerging(), cap)
    assert trace.version_spans == [] and trace.token_versions() == [None, None]


@pytest.mark.parametrize("builder", [PrefixMerging(), PerRequest()], ids=lambda b: b.name)
def test_messages_end_with_the_last_sampled_turn_and_carry_the_tools(builder):
    cap = Capture()
    two_turns(cap)
    last = build(builder, cap)[-1]
    assert last.messages[-1] == {"role": "assistant", "content": "2"}
    assert [m["role"] for m in last.messages] == [
        "system", "user", "assistant", "tool", "assistant",
    ]  # fmt: skip
    assert last.tools == TOOLS


def test_a_record_without_a_reply_keeps_the_request_messages():
    cap = Capture()
    cap.call(opening([100], [200]), [300, EOT], normalized=conv(USER))
    (trace,) = build(PrefixMerging(), cap)
    assert trace.messages == USER and trace.tools == TOOLS
