"""Tool-call parse health from the records to the trace: each failure at its span of the
trace's response, the counts on the trace and in BuildStats, the builder's metrics."""

import random

import msgspec
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from schemas import Artifacts, BuilderSpec, Outcome, SessionFinished, encode
from schemas.completion import ToolParse, ToolParseFailure
from schemas.trajectory import ToolFailure
from services.builder import logic, metrics
from services.builder.strategies import default_registry
from services.builder.strategies.base import full_calls
from services.builder.strategies.per_request import PerRequest
from services.builder.strategies.prefix_merging import PrefixMerging
from tests.unit.builder.synth import EOT, Capture, glue_after, opening, text

OK = Outcome.COMPLETED


def bad_json(start: int, end: int) -> ToolParseFailure:
    return ToolParseFailure(
        kind="malformed", detail="Expecting ',' delimiter", start=start, end=end
    )


UNKNOWN = ToolParseFailure(kind="unknown_tool", detail="no tool named 'rm'")


def tool_loop(cap: Capture, parses: list[ToolParse | None], seed: int = 3):
    """One conversation of ``len(parses)`` calls, call i's record carrying ``parses[i]``."""
    rng = random.Random(seed)
    prompt = opening(text(rng, 30), text(rng, 20))
    for i, parse in enumerate(parses):
        output = text(rng, 12 + i) + [EOT]
        cap.call(prompt, output, tool_parse=parse)
        prompt = prompt + output + glue_after(output, text(rng, 9 + 2 * i))
    return cap.records


def parse(*failures: ToolParseFailure, calls: int = 1) -> ToolParse:
    return ToolParse(ok=not failures, family="qwen3", calls=calls, failures=list(failures))


def test_a_failure_in_the_third_call_of_a_merged_chain_lands_on_its_response_tokens():
    k = 4  # the failure covers output tokens [4, 7) of call 2
    records = tool_loop(Capture(), [parse(), parse(), parse(bad_json(k, k + 3), calls=0), None])
    (trace,), stats, _ = PrefixMerging().build(records, {}, OK)
    assert trace.completion_seqs == [0, 1, 2, 3]
    (f,) = trace.tool_parse.failures
    third = records[2]
    # the third call's output starts where its prompt (the chain so far) ends
    offset = len(full_calls(records).calls[2].prompt) - len(trace.prompt_ids)
    assert (f.seq, f.kind, f.start, f.end) == (2, "malformed", offset + k, offset + k + 3)
    assert trace.response_ids[f.start : f.end] == third.output_ids[k : k + 3]
    assert trace.loss_mask[f.start : f.end] == [1, 1, 1]  # sampled tokens: the model wrote them
    assert f.detail == "Expecting ',' delimiter"
    tp = trace.tool_parse
    # calls 0..2 offered tools (call 3 did not); 1 + 1 parsed, 1 malformed: 3 written
    assert (tp.family, tp.turns, tp.checked, tp.failed, tp.parsed) == ("qwen3", 3, 3, 1, 2)
    assert (stats.tool_turns, stats.tool_calls_checked) == (3, 3)
    assert stats.tool_calls_failed == {"malformed": 1}


def test_a_whole_call_failure_stays_whole_call_and_each_trace_keeps_its_own():
    records = tool_loop(Capture(), [parse(UNKNOWN, calls=2), parse(bad_json(0, 2), calls=0)])
    first, second = PerRequest().build(records, {}, OK)[0]
    assert first.tool_parse.failures == [
        ToolFailure(seq=0, kind="unknown_tool", detail="no tool named 'rm'", start=-1, end=-1)
    ]
    assert (first.tool_parse.checked, first.tool_parse.parsed) == (2, 1)  # the bad call parsed
    (f,) = second.tool_parse.failures  # per_request: the response is the output
    assert (f.seq, f.start, f.end) == (1, 0, 2)
    assert second.response_ids[:2] == records[1].output_ids[:2]


def test_a_span_outside_the_output_is_kept_as_whole_call_and_long_details_are_cut():
    odd = ToolParseFailure(kind="malformed", detail="x" * 1000, start=5, end=999)
    (trace,) = PrefixMerging().build(tool_loop(Capture(), [parse(odd, calls=0)]), {}, OK)[0]
    (f,) = trace.tool_parse.failures
    assert (f.start, f.end) == (-1, -1)
    assert len(f.detail) == 201 and f.detail.endswith("…")


def test_traces_without_tools_carry_nothing_more():
    records = tool_loop(Capture(), [None, None])
    for builder in (PerRequest(), PrefixMerging()):
        traces, stats = builder.build(records, {}, OK)[:2]
        assert all(t.tool_parse is None for t in traces)
        assert all(b"tool_parse" not in encode(t) for t in traces)
        assert b"tool_" not in encode(stats)  # omitted defaults: no growth
    healthy = PrefixMerging().build(tool_loop(Capture(), [parse(), parse()]), {}, OK)[0][0]
    assert msgspec.json.decode(encode(healthy))["tool_parse"] == {
        "family": "qwen3",
        "turns": 2,
        "checked": 2,
    }


def finished(harness="codex") -> SessionFinished:
    return SessionFinished(
        session_id="s-1", task_id="t", outcome=OK, artifacts=Artifacts(harness=harness)
    )


def test_build_stats_count_the_records_whatever_the_builder():
    records = tool_loop(Capture(), [parse(bad_json(0, 1), calls=1), parse(UNKNOWN), None])
    records.append(records[0])  # a redelivered copy counts once
    custom = [f"tests.unit.builder.custom_builders:{c}" for c in ("LastOnly", "Broken")]
    for name in ("per_request", "prefix_merging", *custom):
        t = logic.build_trajectory(finished(), BuilderSpec(name=name), records, default_registry())
        assert (t.stats.tool_turns, t.stats.tool_calls_checked) == (2, 3), name
        assert t.stats.tool_calls_failed == {"malformed": 1, "unknown_tool": 1}, name


def samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every builder tool-parse sample of the process's registry, as rendered for /metrics."""
    text_ = generate_latest(REGISTRY).decode()
    out = {}
    for fam in text_string_to_metric_families(text_):
        if fam.name.startswith("polar_builder_tool_"):
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_checked_and_failed_calls_by_harness_family_and_kind():
    before = samples()
    records = tool_loop(
        Capture(),
        [parse(bad_json(0, 1), calls=2), parse(UNKNOWN), parse(), None],
    )
    metrics.observe_tool_parse("mh-harness", records)
    metrics.observe_tool_parse("mh-harness", tool_loop(Capture("s-2"), [parse(), parse()]))
    metrics.observe_tool_parse(None, tool_loop(Capture("s-3"), [parse()]))
    after = samples()
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    fam = (("family", "qwen3"),)
    assert delta == {
        # 3 + 1 + 1 written in the first session, 1 + 1 in the second
        ("polar_builder_tool_calls_checked_total", (*fam, ("harness", "mh-harness"))): 7.0,
        ("polar_builder_tool_calls_checked_total", (*fam, ("harness", "-"))): 1.0,
        (
            "polar_builder_tool_calls_failed_total",
            (*fam, ("harness", "mh-harness"), ("kind", "malformed")),
        ): 1.0,
        (
            "polar_builder_tool_calls_failed_total",
            (*fam, ("harness", "mh-harness"), ("kind", "unknown_tool")),
        ): 1.0,
        (
            "polar_builder_tool_parse_sessions_total",
            (*fam, ("harness", "mh-harness"), ("result", "failed")),
        ): 1.0,
        (
            "polar_builder_tool_parse_sessions_total",
            (*fam, ("harness", "mh-harness"), ("result", "clean")),
        ): 1.0,
        (
            "polar_builder_tool_parse_sessions_total",
            (*fam, ("harness", "-"), ("result", "clean")),
        ): 1.0,
    }


def task_samples() -> dict[tuple[str, str], float]:
    text_ = generate_latest(REGISTRY).decode()
    return {
        (s.labels["task"], s.labels["result"]): s.value
        for fam in text_string_to_metric_families(text_)
        if fam.name == "polar_builder_task_tool_calls"
        for s in fam.samples
        if s.name.endswith("_total")
    }


def test_per_task_counts_for_the_most_recent_tasks_only(monkeypatch):
    monkeypatch.setattr(metrics, "RECENT_TASKS", 2)
    monkeypatch.setattr(metrics, "_recent_tasks", type(metrics._recent_tasks)())
    records = tool_loop(Capture(), [parse(bad_json(0, 1), calls=2), parse()])
    metrics.observe_tool_parse("h", records, "pt-task-a")
    metrics.observe_tool_parse("h", records, "pt-task-a")  # a second session of the task
    assert task_samples()[("pt-task-a", "checked")] == 8.0
    assert task_samples()[("pt-task-a", "failed")] == 2.0
    metrics.observe_tool_parse("h", records, "pt-task-b")
    metrics.observe_tool_parse("h", tool_loop(Capture(), [None]), "pt-task-c")  # no tools
    assert ("pt-task-a", "checked") in task_samples()  # a session without tools: no task
    metrics.observe_tool_parse("h", records, "pt-task-d")
    seen = {task for task, _ in task_samples() if task.startswith("pt-task-")}
    assert seen == {"pt-task-b", "pt-task-d"}  # a, the oldest of three, dropped
