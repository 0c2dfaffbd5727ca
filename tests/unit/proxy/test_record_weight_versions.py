"""A call's record says which weights produced which of its tokens when a swap came
mid-call (``proxy.capture.build_record``, a plain function)."""

from __future__ import annotations

from proxy.backends.base import Generation
from proxy.capture import CallContext, build_record
from proxy.tito import PromptPlan
from schemas import CompletionRecord, Protocol, UpstreamMode, decode, encode

CTX = CallContext(
    session_id="t-0000",
    attempt=0,
    protocol=Protocol("openai_chat"),
    mode=UpstreamMode.TOKEN,
    model="m",
    raw_request=b"{}",
    normalized=b"null",
    user_agent=None,
    side_call=None,
    received=0.0,
)
PLAN = PromptPlan([1, 2, 3], None, None, None)


def generation(**versions) -> Generation:
    return Generation(
        prompt_ids=[1, 2, 3],
        output_ids=[7, 8, 9, 10],
        output_logprobs=[-0.1] * 4,
        finish_reason="stop",
        weight_version="v2",
        **versions,
    )


def test_a_swap_mid_call_is_on_the_record():
    gen = generation(weight_versions=["v1", "v2"], weight_version_starts=[0, 3])
    rec = build_record(CTX, 0, PLAN, gen)
    assert (rec.weight_version, rec.weight_versions, rec.weight_version_starts) == (
        "v2",
        ["v1", "v2"],
        [0, 3],
    )
    back = decode(encode(rec), CompletionRecord)  # and survives the bus
    assert back.weight_versions == ["v1", "v2"] and back.weight_version_starts == [0, 3]


def test_one_version_throughout_is_just_the_weight_version():
    for gen in (generation(), generation(weight_versions=["v2"], weight_version_starts=[0])):
        rec = build_record(CTX, 0, PLAN, gen)
        assert rec.weight_version == "v2"
        assert rec.weight_versions == [] and rec.weight_version_starts == []
        assert b"weight_versions" not in encode(rec)  # nothing added to the payload
