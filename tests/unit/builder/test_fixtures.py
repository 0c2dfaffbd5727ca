"""Builders on the stored CompletionRecord fixtures (tests/fixtures/completions/README.md).

``sub_agent``, ``compaction``, ``side_calls`` and ``side_calls_router`` are recordings of
real agent CLIs (Claude Code, Codex, opencode, Gemini CLI) through the real proxy in token
mode; ``token_30turn`` is generated from the real embedded model.
"""

from pathlib import Path

import msgspec
import orjson
import pytest

from schemas import CompletionRecord, Outcome, UpstreamMode
from schemas.completion import reconstruct_prompts
from services.builder.strategies.per_request import PerRequest
from services.builder.strategies.prefix_merging import PrefixMerging

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "completions"
RECORDED = {  # fixture -> the CLI that made the calls, as its User-Agent says
    "sub_agent": "claude-cli/2.1.332 ",
    "compaction": "codex_exec/0.171.0 ",
    "side_calls": "opencode/1.18.33 ",
    "side_calls_router": "GeminiCLI-tui/0.61.0/",
}


def load(name: str) -> list[CompletionRecord]:
    lines = (FIXTURES / f"{name}.jsonl").read_bytes().splitlines()
    return [msgspec.json.decode(line, type=CompletionRecord) for line in lines]


def merged(records):
    return PrefixMerging().build(records, {}, Outcome.COMPLETED)


def body(rec: CompletionRecord) -> dict:
    return orjson.loads(bytes(rec.raw_request))


def parts(message: dict) -> list[dict]:
    content = message["content"]
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def assert_exact(records, traces) -> None:
    """Every record is in exactly one chain; each chain is its last call's prompt + output,
    with every record's output, logprobs and mask 1 at that call's place, and mask 0 (no
    logprob) everywhere else."""
    seqs = [s for t in traces for s in t.completion_seqs]
    assert sorted(seqs) == [r.seq for r in records]  # nothing dropped, nothing twice
    prompts, by_seq = reconstruct_prompts(records), {r.seq: r for r in records}
    for t in traces:
        first, last = by_seq[t.completion_seqs[0]], by_seq[t.completion_seqs[-1]]
        assert t.prompt_ids == prompts[first.seq]
        assert t.prompt_ids + t.response_ids == prompts[last.seq] + last.output_ids
        sampled = set()
        for seq in t.completion_seqs:
            out, start = by_seq[seq].output_ids, len(prompts[seq]) - len(t.prompt_ids)
            assert t.response_ids[start : start + len(out)] == out
            assert t.response_logprobs[start : start + len(out)] == by_seq[seq].output_logprobs
            sampled.update(range(start, start + len(out)))
        assert {i for i, m in enumerate(t.loss_mask) if m} == sampled
        assert all(lp is None for i, lp in enumerate(t.response_logprobs) if i not in sampled)


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
    assert_exact(records, traces)
    assert stats.sampled_tokens == sum(len(r.output_ids) for r in records)
    assert stats.breaks == {"first": 1}
    # the length-truncated turn 11 is closed by the template's eot: glue, mask 0
    assert records[11].finish_reason == "length" and notes["turns_closed_by_glue"] == [11]
    eot_at = len(prompts[11]) + len(records[11].output_ids) - len(prompts[0])
    assert t.response_ids[eot_at] == notes["eot_token_id"] and t.loss_mask[eot_at] == 0
    per_request, pr_stats = PerRequest().build(records, {}, Outcome.COMPLETED)
    assert len(per_request) == 30 and pr_stats.tokens == round(stats.tokens * stats.merge_ratio)


@pytest.mark.parametrize("name", list(RECORDED))
def test_fixture_is_a_recording_through_the_proxy(name):
    records = load(name)
    assert [r.seq for r in records] == list(range(len(records)))
    assert len({r.session_id for r in records}) == 1
    assert all(r.user_agent.startswith(RECORDED[name]) for r in records)
    assert all(r.mode == UpstreamMode.TOKEN and r.timings is not None for r in records)
    assert all(body(r) and orjson.loads(bytes(r.normalized)) for r in records)
    assert all(len(r.output_logprobs) == len(r.output_ids) > 0 for r in records)
    traces, stats, _ = merged(records)
    assert_exact(records, traces)
    assert stats.sampled_tokens == sum(sum(t.loss_mask) for t in traces)


def test_claude_code_sub_agents_are_separate_chains_of_the_main_loop():
    records = load("sub_agent")
    traces, stats, _ = merged(records)
    main, one, two = traces
    assert [t.break_reason for t in traces] == ["first", "sub_agent", "sub_agent"]
    assert main.completion_seqs == [0, 3, 4, 7, 8, 9]
    assert (one.completion_seqs, two.completion_seqs) == ([1, 2], [5, 6])
    # both were started by the main loop, not one by the other
    assert one.lineage_id == two.lineage_id == main.trace_id and main.lineage_id is None
    assert stats.breaks == {"first": 1, "sub_agent": 2}
    # the main loop's Agent calls, and the sub-agents' reports as their results
    history = body(records[9])["messages"]
    uses = [c for m in history for c in parts(m) if c.get("name") == "Agent"]
    assert [u["input"]["subagent_type"] for u in uses] == ["general-purpose"] * 2
    results = [str(c["content"]) for m in history for c in parts(m) if c["type"] == "tool_result"]
    assert sum("POLAR-SUB-REPORT" in r for r in results) == 2
    # ... and each sub-agent ran with its own system prompt and tools
    main_tools = {t["name"] for t in body(records[0])["tools"]}
    sub_tools = {t["name"] for t in body(records[1])["tools"]}
    assert "Agent" in main_tools and main_tools != sub_tools
    assert body(records[1])["system"][1:] != body(records[0])["system"][1:]
    assert all(r.drift_reason == "system_prompt_changed" for r in (records[1], records[5]))


def test_codex_compaction_summary_and_compacted_history_are_separate_chains():
    records = load("compaction")
    traces, stats, notes = merged(records)
    main, summary, compacted = traces
    assert [t.break_reason for t in traces] == ["first", "side_call:compaction", "compaction"]
    assert [t.completion_seqs for t in traces] == [[0, 1], [2], [3, 4, 5]]
    assert summary.lineage_id == compacted.lineage_id == main.trace_id
    assert summary.side_call == "compaction" and compacted.side_call is None
    assert stats.breaks == {"first": 1, "side_call:compaction": 1, "compaction": 1}
    # the proxy tagged the summarization request `title`; the builder says what it was
    assert records[2].side_call == "title"
    assert notes["retagged_chains"] == {"2": "side_call:title"}
    ask = body(records[2])
    assert not ask.get("tools") and "CONTEXT CHECKPOINT COMPACTION" in str(ask["input"][-1])
    # the compacted history is shorter than what it replaced and carries the summary
    prompts = reconstruct_prompts(records)
    assert len(prompts[3]) < len(prompts[1])
    assert "POLAR-SUMMARY" in str(body(records[3])["input"][-1])
    assert "POLAR-SUMMARY" not in str(body(records[1])["input"])


@pytest.mark.parametrize("tagged", ["by_todays_proxy", "untagged"])
def test_the_summarization_call_is_found_however_the_proxy_tagged_it(tagged):
    """The recording's proxy said ``title``; today's says ``compaction``; a proxy that
    does not recognise the request says nothing. The chains are the same each way."""
    from proxy.protocols import openai_responses
    from proxy.sidecalls import classify

    records = []
    for rec in load("compaction"):
        tag = None
        if tagged == "by_todays_proxy":
            tag = classify(rec.protocol.value, openai_responses.parse_request(body(rec), {}, {}))
        records.append(msgspec.structs.replace(rec, side_call=tag))
    if tagged == "by_todays_proxy":
        assert [r.side_call for r in records] == [None, None, "compaction", None, None, None]
    traces, stats, notes = merged(records)
    main, summary, compacted = traces
    assert [t.completion_seqs for t in traces] == [[0, 1], [2], [3, 4, 5]]
    assert [t.break_reason for t in traces] == ["first", "side_call:compaction", "compaction"]
    assert summary.lineage_id == compacted.lineage_id == main.trace_id
    assert_exact(records, traces)


@pytest.mark.parametrize(
    ("name", "tag"), [("side_calls", "title"), ("side_calls_router", "router")]
)
def test_side_call_before_the_main_loop_is_its_own_chain(name, tag):
    records = load(name)
    traces, stats, _ = merged(records)
    side, main = traces
    assert (side.break_reason, side.side_call, side.completion_seqs) == (
        f"side_call:{tag}",
        tag,
        [0],
    )
    assert (main.break_reason, main.completion_seqs) == ("first", [1, 2, 3])
    assert side.lineage_id == main.trace_id and main.lineage_id is None
    assert stats.breaks == {f"side_call:{tag}": 1, "first": 1}
    assert not body(records[0]).get("tools") and body(records[1]).get("tools")
    assert all(r.extends_previous for r in records[2:])
