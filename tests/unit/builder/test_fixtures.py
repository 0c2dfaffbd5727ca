"""Builders on the stored CompletionRecord fixtures (real tokens from the embedded model;
see tests/fixtures/completions/README.md)."""

from pathlib import Path

import msgspec
import pytest

from schemas import CompletionRecord, Outcome, UpstreamMode
from schemas.completion import reconstruct_prompts
from services.builder.strategies.per_request import PerRequest
from services.builder.strategies.prefix_merging import PrefixMerging

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "completions"


def load(name: str) -> list[CompletionRecord]:
    lines = (FIXTURES / f"{name}.jsonl").read_bytes().splitlines()
    return [msgspec.json.decode(line, type=CompletionRecord) for line in lines]


def merged(records):
    return PrefixMerging().build(records, {}, Outcome.COMPLETED)


def test_30_turn_token_mode_session_merges_into_one_exact_chain():
    records = load("token_30turn")
    assert len(records) == 30 and all(r.mode == UpstreamMode.TOKEN for r in records)
    assert all(r.extends_previous for r in records[1:])
    assert sum(r.prompt_base_seq is not None for r in records) == 29  # stored incrementally
    prompts = reconstruct_prompts(records)
    traces, stats, notes = merged(records)
    assert len(traces) == 1
    (t,) = traces
    assert t.prompt_ids + t.response_ids == prompts[29] + records[29].output_ids
    assert t.prompt_ids == prompts[0]
    sampled = set()  # positions (in the response) of every sampled token
    for r in records:
        start = len(prompts[r.seq]) - len(prompts[0])
        assert t.response_ids[start : start + len(r.output_ids)] == r.output_ids
        assert t.response_logprobs[start : start + len(r.output_ids)] == r.output_logprobs
        sampled.update(range(start, start + len(r.output_ids)))
    assert {i for i, m in enumerate(t.loss_mask) if m} == sampled
    assert all(lp is None for i, lp in enumerate(t.response_logprobs) if i not in sampled)
    assert stats.sampled_tokens == len(sampled) and stats.breaks == {"first": 1}
    # the length-truncated turn 11 is closed by the template's eot: glue, mask 0
    assert records[11].finish_reason == "length" and notes["turns_closed_by_glue"] == [11]
    eot_at = len(prompts[11]) + len(records[11].output_ids) - len(prompts[0])
    assert t.response_ids[eot_at] == notes["eot_token_id"] and t.loss_mask[eot_at] == 0
    per_request, pr_stats = PerRequest().build(records, {}, Outcome.COMPLETED)
    assert len(per_request) == 30 and pr_stats.tokens == round(stats.tokens * stats.merge_ratio)


def test_side_calls_are_separate_chains():
    traces, stats, _ = merged(load("side_calls"))
    main = [t for t in traces if t.side_call is None]
    assert len(main) == 1 and len(main[0].completion_seqs) == 6
    side = {t.break_reason: t for t in traces if t.side_call}
    assert set(side) == {"side_call:title", "side_call:count_tokens", "side_call:router"}
    assert all(t.lineage_id == main[0].trace_id for t in side.values())
    assert stats.breaks == {
        "first": 1,
        "side_call:title": 1,
        "side_call:count_tokens": 1,
        "side_call:router": 1,
    }


@pytest.mark.parametrize(
    ("name", "reasons"),
    [
        ("sub_agent", ["first", "sub_agent", "sub_agent"]),
        ("compaction", ["first", "compaction"]),
    ],
)
def test_sub_agent_and_compaction_fixtures(name, reasons):
    records = load(name)
    traces, stats, _ = merged(records)
    assert [t.break_reason for t in traces] == reasons
    assert traces[1].lineage_id == traces[0].trace_id
    assert sorted(s for t in traces for s in t.completion_seqs) == [r.seq for r in records]
    assert stats.sampled_tokens == sum(sum(t.loss_mask) for t in traces)
