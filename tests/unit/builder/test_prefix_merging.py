"""prefix_merging and per_request on synthetic token sequences."""

import random

import pytest

from schemas import Outcome, UpstreamMode
from services.builder.strategies.base import full_calls
from services.builder.strategies.per_request import PerRequest
from services.builder.strategies.prefix_merging import PrefixMerging
from tests.unit.builder.synth import (
    EOT,
    GEN,
    NL,
    Capture,
    agent_loop,
    glue_after,
    msg,
    opening,
    text,
)

OK = Outcome.COMPLETED


def merge(records, **config):
    return PrefixMerging().build(records, config, OK)


def sampled_positions(trace):
    return [i for i, m in enumerate(trace.loss_mask) if m]


def expected_positions(trace, records):
    """Where each record's output must sit in a merged trace's response."""
    n_prompt = len(trace.prompt_ids)
    pos, by_seq = [], {r.seq: r for r in records}
    full = trace.prompt_ids + trace.response_ids
    for seq in trace.completion_seqs:
        out = by_seq[seq].output_ids
        # the output sits right after that call's full prompt: find it from the left
        start = _prompt_len(records, seq)
        assert full[start : start + len(out)] == out
        pos += range(start - n_prompt, start - n_prompt + len(out))
    return pos


def _prompt_len(records, seq):
    from schemas.completion import reconstruct_prompts

    return len(reconstruct_prompts(records)[seq])


def test_linear_tool_session_is_one_chain():
    cap = Capture()
    last_prompt, last_out = agent_loop(cap, random.Random(1), 12)
    traces, stats, notes = merge(cap.records)
    assert len(traces) == 1 and stats.chains == 1
    t = traces[0]
    assert t.prompt_ids + t.response_ids == last_prompt + last_out
    assert t.break_reason == "first" and t.lineage_id is None
    assert t.completion_seqs == list(range(12))
    assert sampled_positions(t) == expected_positions(t, cap.records)
    assert sum(t.loss_mask) == sum(len(r.output_ids) for r in cap.records) == stats.sampled_tokens
    for m, lp in zip(t.loss_mask, t.response_logprobs, strict=True):
        assert (lp is None) == (m == 0)  # glue has no logprob, every sampled token has one
    assert stats.tokens == len(last_prompt) + len(last_out)
    per_request = sum(len(_full(cap.records, r.seq)) + len(r.output_ids) for r in cap.records)
    assert stats.merge_ratio == round(per_request / stats.tokens, 4) and stats.merge_ratio > 3
    assert stats.breaks == {"first": 1}
    assert notes["eot_token_id"] == EOT and notes["eot_source"] == "detected"


def _full(records, seq):
    from schemas.completion import reconstruct_prompts

    return reconstruct_prompts(records)[seq]


def test_per_request_one_trace_per_completion():
    cap = Capture()
    agent_loop(cap, random.Random(2), 7)
    traces, stats = PerRequest().build(cap.records, {}, OK)
    assert len(traces) == 7 == stats.chains == stats.completions
    for t, r in zip(traces, cap.records, strict=True):
        assert t.prompt_ids == _full(cap.records, r.seq)  # delta encoding undone
        assert t.response_ids == r.output_ids and t.loss_mask == [1] * len(r.output_ids)
        assert t.response_logprobs == r.output_logprobs and t.completion_seqs == [r.seq]
    assert stats.merge_ratio == 1.0 and stats.breaks == {}


def test_length_truncated_turn_is_closed_by_glue():
    cap = Capture()
    rng = random.Random(3)
    p0 = opening(text(rng, 10), text(rng, 5))
    o0 = text(rng, 8)  # hit max_tokens: no end-of-turn
    cap.call(p0, o0, finish="length")
    p1 = p0 + o0 + glue_after(o0, text(rng, 6))
    assert p1[len(p0) + len(o0)] == EOT  # the template closes the turn
    o1 = text(rng, 4) + [EOT]
    cap.call(p1, o1, finish="stop")
    (t,), stats, notes = merge(cap.records)
    eot_at = len(p0) + len(o0) - len(t.prompt_ids)
    assert t.response_ids[eot_at] == EOT
    assert t.loss_mask[eot_at] == 0 and t.response_logprobs[eot_at] is None
    assert sum(t.loss_mask) == len(o0) + len(o1)
    assert notes["turns_closed_by_glue"] == [0]
    assert notes["turns_closed_by_glue_by_finish"] == {"length": 1}


def test_stop_without_reported_eot_gets_glue_eot():
    cap = Capture()
    rng = random.Random(4)
    p0 = opening(text(rng, 10), text(rng, 5))
    o0 = text(rng, 5)  # engine finished on stop but did not return the eot id
    cap.call(p0, o0, finish="stop")
    p1 = p0 + o0 + glue_after(o0, text(rng, 6))
    cap.call(p1, text(rng, 3) + [EOT], finish="stop")
    (t,), _, notes = merge(cap.records)
    assert notes["turns_closed_by_glue_by_finish"] == {"stop": 1}
    assert t.loss_mask[len(o0)] == 0  # the eot the next prompt adds is glue


def test_eot_from_config_wins_over_detection():
    cap = Capture()
    agent_loop(cap, random.Random(5), 3)
    _, _, notes = merge(cap.records, eot_token_id=NL)
    assert notes["eot_token_id"] == NL and notes["eot_source"] == "config"
    cap2 = Capture()
    cap2.call([5, 6], [7], finish="length")
    _, _, notes = merge(cap2.records)
    assert notes["eot_token_id"] is None and notes["eot_source"] == "unknown"


def loop_turn(cap, rng, prompt, *, finish="tool_calls", **kw):
    out = text(rng, 6) + [EOT]
    cap.call(prompt, out, finish=finish, **kw)
    return prompt + out + glue_after(out, text(rng, 7))


def test_side_calls_get_their_own_chain_with_lineage():
    cap, rng = Capture(), random.Random(6)
    p = opening(text(rng, 12), text(rng, 5))
    p = loop_turn(cap, rng, p)
    title_prompt = msg("system", text(rng, 4)) + msg("user", text(rng, 3)) + GEN
    cap.call(title_prompt, text(rng, 3) + [EOT], finish="stop", side_call="title")
    p = loop_turn(cap, rng, p)
    cap.call(p[:20], [], finish="stop", side_call="count_tokens")
    p = loop_turn(cap, rng, p, finish="stop")
    traces, stats, _ = merge(cap.records)
    main = [t for t in traces if t.side_call is None]
    assert len(main) == 1 and main[0].completion_seqs == [0, 2, 4]
    side = {t.side_call: t for t in traces if t.side_call}
    assert side["title"].break_reason == "side_call:title"
    assert side["count_tokens"].break_reason == "side_call:count_tokens"
    assert side["title"].lineage_id == main[0].trace_id == side["count_tokens"].lineage_id
    assert not side["count_tokens"].trainable  # nothing sampled
    assert stats.breaks == {"first": 1, "side_call:title": 1, "side_call:count_tokens": 1}


def test_sub_agent_with_its_own_system_prompt():
    cap, rng = Capture(), random.Random(7)
    main = opening(text(rng, 12), text(rng, 5))
    main = loop_turn(cap, rng, main)
    sub = opening(text(rng, 9), text(rng, 4))  # different system prompt
    sub = loop_turn(cap, rng, sub)
    main = loop_turn(cap, rng, main)  # main and sub interleave
    sub = loop_turn(cap, rng, sub, finish="stop")
    main = loop_turn(cap, rng, main, finish="stop")
    traces, stats, _ = merge(cap.records)
    assert [t.completion_seqs for t in traces] == [[0, 2, 4], [1, 3]]
    assert traces[1].break_reason == "sub_agent" and traces[1].lineage_id == traces[0].trace_id
    assert stats.breaks == {"first": 1, "sub_agent": 1}


def test_sub_agent_with_the_same_system_prompt_runs_beside_its_parent():
    cap, rng = Capture(), random.Random(8)
    system = text(rng, 12)
    main = opening(system, text(rng, 5))
    main = loop_turn(cap, rng, main)
    main = loop_turn(cap, rng, main)
    sub = opening(system, text(rng, 4))  # same system, shorter: looks like a compaction...
    loop_turn(cap, rng, sub, finish="stop")
    loop_turn(cap, rng, main, finish="stop")  # ...but the parent goes on: a sub-agent
    traces, stats, _ = merge(cap.records)
    assert traces[1].break_reason == "sub_agent" and stats.breaks["sub_agent"] == 1


def test_compaction_replaces_the_history():
    cap, rng = Capture(), random.Random(9)
    system = text(rng, 12)
    main = opening(system, text(rng, 5))
    for _ in range(4):
        main = loop_turn(cap, rng, main)
    compacted = opening(system, text(rng, 15))  # same system, summary instead of history
    for _ in range(3):
        compacted = loop_turn(cap, rng, compacted)
    traces, stats, _ = merge(cap.records)
    assert [t.completion_seqs for t in traces] == [[0, 1, 2, 3], [4, 5, 6]]
    assert traces[1].break_reason == "compaction" and traces[1].lineage_id == traces[0].trace_id
    assert stats.breaks == {"first": 1, "compaction": 1}


def test_sub_agents_of_one_kind_started_in_turn_descend_from_the_loop():
    """Claude Code starting one general-purpose sub-agent after another: the second shares
    its whole first message with the first, yet the main loop started both."""
    cap, rng = Capture(), random.Random(11)
    main = opening(text(rng, 12), text(rng, 5))
    sub_system = text(rng, 9)
    main = loop_turn(cap, rng, main)  # calls the Agent tool
    loop_turn(cap, rng, loop_turn(cap, rng, opening(sub_system, text(rng, 4))), finish="stop")
    main = loop_turn(cap, rng, main)  # the report came back; calls the Agent tool again
    loop_turn(cap, rng, loop_turn(cap, rng, opening(sub_system, text(rng, 4))), finish="stop")
    loop_turn(cap, rng, main, finish="stop")
    traces, stats, _ = merge(cap.records)
    assert [t.completion_seqs for t in traces] == [[0, 3, 6], [1, 2], [4, 5]]
    assert [t.break_reason for t in traces] == ["first", "sub_agent", "sub_agent"]
    assert traces[1].lineage_id == traces[2].lineage_id == traces[0].trace_id


def test_nested_sub_agent_of_another_kind_descends_from_its_starter():
    cap, rng = Capture(), random.Random(12)
    main = loop_turn(cap, rng, opening(text(rng, 12), text(rng, 5)))
    sub = loop_turn(cap, rng, opening(text(rng, 9), text(rng, 4)))  # started by main
    loop_turn(cap, rng, opening(text(rng, 7), text(rng, 3)), finish="stop")  # by sub
    loop_turn(cap, rng, sub, finish="stop")
    loop_turn(cap, rng, main, finish="stop")
    traces, _, _ = merge(cap.records)
    assert [t.break_reason for t in traces] == ["first", "sub_agent", "sub_agent"]
    assert traces[1].lineage_id == traces[0].trace_id
    assert traces[2].lineage_id == traces[1].trace_id  # equal prefixes: the latest active


def summarize(cap, rng, main, *, side_call="title", carry=True):
    """Codex's compaction: the summarization request (no tools, so another first message),
    then the compacted conversation (same first message, the summary in the task)."""
    system = main[3 : main.index(EOT)]
    summary = text(rng, 20) + [EOT]
    ask = opening(text(rng, 10), text(rng, 30))  # history + "summarize", another head
    cap.call(ask, summary, finish="stop", side_call=side_call)
    carried = summary[:-1] if carry else text(rng, 20)
    return opening(system, text(rng, 5) + carried)


def test_summarization_call_of_a_compaction_is_a_compaction_side_call():
    cap, rng = Capture(), random.Random(13)
    main = opening(text(rng, 12), text(rng, 5))
    for _ in range(3):
        main = loop_turn(cap, rng, main)
    compacted = summarize(cap, rng, main)
    for _ in range(2):
        compacted = loop_turn(cap, rng, compacted)
    traces, stats, notes = merge(cap.records)
    assert [t.completion_seqs for t in traces] == [[0, 1, 2], [3], [4, 5]]
    assert [t.break_reason for t in traces] == ["first", "side_call:compaction", "compaction"]
    assert traces[1].side_call == "compaction" and traces[1].trainable
    assert traces[1].lineage_id == traces[2].lineage_id == traces[0].trace_id
    assert notes["retagged_chains"] == {"3": "side_call:title"}
    assert stats.breaks == {"first": 1, "side_call:compaction": 1, "compaction": 1}


def test_a_side_call_whose_output_is_not_carried_keeps_its_tag():
    cap, rng = Capture(), random.Random(14)
    main = opening(text(rng, 12), text(rng, 5))
    for _ in range(3):
        main = loop_turn(cap, rng, main)
    loop_turn(cap, rng, summarize(cap, rng, main, carry=False))
    traces, _, notes = merge(cap.records)
    assert [t.break_reason for t in traces] == ["first", "side_call:title", "compaction"]
    assert traces[1].side_call == "title" and "retagged_chains" not in notes


def test_side_call_before_the_main_loop_descends_from_the_first_chain():
    cap, rng = Capture(), random.Random(15)
    title = msg("system", text(rng, 4)) + msg("user", text(rng, 3)) + GEN
    cap.call(title, text(rng, 3) + [EOT], finish="stop", side_call="title")  # opencode
    loop_turn(cap, rng, loop_turn(cap, rng, opening(text(rng, 12), text(rng, 5))))
    traces, _, _ = merge(cap.records)
    assert [t.break_reason for t in traces] == ["side_call:title", "first"]
    assert traces[0].lineage_id == traces[1].trace_id and traces[1].lineage_id is None


def test_history_rewritten_and_retry():
    cap, rng = Capture(), random.Random(10)
    p0 = opening(text(rng, 12), text(rng, 5))
    p1 = loop_turn(cap, rng, p0)
    p2 = loop_turn(cap, rng, p1)
    cap.call(p1, text(rng, 4) + [EOT])  # the tip's prompt again: a retry
    rewritten = list(p2)
    rewritten[len(p0) + 2] = 999  # an earlier turn re-serialized: same length, differs
    cap.call(rewritten, text(rng, 2) + [EOT], finish="stop")
    traces, stats, _ = merge(cap.records)
    assert [t.break_reason for t in traces] == ["first", "retry", "history_rewritten"]
    assert traces[1].lineage_id == traces[0].trace_id
    assert traces[2].lineage_id == traces[1].trace_id  # equal shared prefix: the most recent
    assert stats.breaks == {"first": 1, "retry": 1, "history_rewritten": 1}


def test_chat_mode_drift_breaks_with_response_retokenized():
    cap, rng = Capture(mode=UpstreamMode.CHAT), random.Random(11)
    p0 = opening(text(rng, 12), text(rng, 5))
    o0 = text(rng, 6) + [EOT]
    cap.call(p0, o0, drift_reason=None)
    retemplated = [o0[0] + 1, *o0[1:]]  # the engine re-rendered the reply differently
    p1 = p0 + retemplated + glue_after(retemplated, text(rng, 5))
    cap.call(p1, text(rng, 3) + [EOT], finish="stop", drift_reason="reply re-rendered")
    traces, stats, notes = merge(cap.records)
    assert [t.break_reason for t in traces] == ["first", "response_retokenized"]
    assert traces[0].response_ids == o0  # the sampled reply is kept, not overwritten
    assert notes["drift_reasons"] == {"1": "reply re-rendered"}


def test_longest_joinable_chain_wins():
    cap, rng = Capture(), random.Random(12)
    p0 = opening(text(rng, 12), text(rng, 5))
    o0 = text(rng, 4)
    cap.call(p0, o0, finish="length")
    cap.call(p0, o0 + [555, EOT])  # a retry that sampled further: a longer chain
    p2 = p0 + o0 + [555, EOT] + glue_after([EOT], text(rng, 5))
    cap.call(p2, [7, EOT], finish="stop")
    traces, _, _ = merge(cap.records)
    assert [t.completion_seqs for t in traces] == [[0], [1, 2]]


def test_aborted_turn_ends_its_chain():
    cap, rng = Capture(), random.Random(13)
    p0 = opening(text(rng, 12), text(rng, 5))
    p1 = loop_turn(cap, rng, p0)
    o1 = text(rng, 3)
    cap.call(p1, o1, finish="abort", aborted=True)
    p2 = p1 + o1 + glue_after(o1, text(rng, 4))  # would extend it, but the turn was cut
    cap.call(p2, [8, EOT], finish="stop")
    traces, stats, _ = merge(cap.records)
    assert [t.completion_seqs for t in traces] == [[0, 1], [2]]
    assert traces[1].break_reason == "after_abort"
    assert sum(traces[0].loss_mask) == 7 + 3  # the partial output was sampled: kept


def test_weight_versions_spanned():
    cap, rng = Capture(), random.Random(14)
    p = opening(text(rng, 12), text(rng, 5))
    out = text(rng, 4) + [EOT]
    cap.call(p, out, weight_version="v1")
    p = p + out + glue_after(out, [9])
    cap.call(p, [5, EOT], weight_version="v2", finish="stop")
    (t,), _, _ = merge(cap.records)
    assert t.weight_versions == ["v1", "v2"]


def test_missing_base_record_is_set_aside():
    cap = Capture()
    agent_loop(cap, random.Random(15), 4)
    kept = [r for r in cap.records if r.seq != 1]  # seq 2 is delta-encoded on seq 1
    assert cap.records[2].prompt_base_seq == 1
    calls = full_calls(kept)
    assert [c.seq for c in calls.calls] == [0] and calls.unreconstructable == [2, 3]
    traces, stats, _ = merge(kept)
    assert stats.completions == 1 and [t.completion_seqs for t in traces] == [[0]]


def test_empty_session():
    traces, stats, _ = merge([])
    assert traces == [] and stats.tokens == 0 and stats.chains == 0


@pytest.mark.parametrize("bad", [{"eot": 2}, {"eot_token_id": "two"}])
def test_bad_config_says_which_keys_are_accepted(bad):
    from services.builder.strategies.base import BuildError

    with pytest.raises(BuildError, match="accepted keys: eot_token_id"):
        merge([], **bad)


@pytest.mark.parametrize("cause", ["reasoning_dropped", "history_rerendered"])
def test_a_rerendered_history_is_named_by_its_cause_never_compaction(cause):
    """Qwen3's template drops earlier reasoning once a new user turn follows: under the
    proxy's ``rerender`` history policy the next prompt is shorter than the tip's, which
    alone would read as a compaction; the record says why and the trace says the same."""
    cap, rng = Capture(), random.Random(13)
    p0 = opening(text(rng, 70), text(rng, 5))
    thinking = text(rng, 30)  # the reasoning tokens of the first answer
    o0 = [*thinking, *text(rng, 4), EOT]
    cap.call(p0, o0)
    p1 = p0 + o0 + glue_after(o0, text(rng, 5))
    o1 = text(rng, 6) + [EOT]
    cap.call(p1, o1, finish="stop")
    # the history re-rendered without the reasoning, then a new user turn
    rerendered = p0 + o0[len(thinking) :] + glue_after(o0, text(rng, 5))[:-3] + o1
    p2 = [*rerendered, 3, *msg("user", text(rng, 3)), *GEN]
    assert len(p2) < len(p1 + o1)
    cap.call(p2, text(rng, 3) + [EOT], finish="stop", drift_reason=cause, extends_previous=False)
    assert cap.records[-1].prompt_base_seq == 1  # the proxy compared it with the tip
    traces, stats, _ = merge(cap.records)
    assert [t.break_reason for t in traces] == ["first", cause]
    assert traces[1].lineage_id == traces[0].trace_id
    assert stats.breaks == {"first": 1, cause: 1}
