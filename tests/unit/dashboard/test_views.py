"""What each dashboard page shows, from schema structs alone (no server)."""

import random

import msgspec
import orjson

from evaluators.rubric import JudgeReply, judge_record
from schemas import Artifacts, BuildStats, Outcome, Timings, Trace, Trajectory, VersionSpan
from schemas.completion import ReplayMark, ToolParse, ToolParseFailure
from schemas.routing import RoutedExperts, RoutingSegment, TraceRouting
from services.dashboard import trajectory, views
from services.dashboard.index import SessionIndex, SessionRow
from tests.unit.builder.synth import Capture, agent_loop, glue_after, opening, text


def records_with_a_break():
    """Three calls of one loop, then a prompt that rewrites the system message: two
    chains in prefix_merging, the second with a break reason."""
    rng = random.Random(7)
    cap = Capture("t-0000")
    agent_loop(cap, rng, 3)
    cap.call(opening(text(rng, 30), text(rng, 20)), text(rng, 6) + [2], finish="stop")
    return cap.records


def test_both_builders_rebuild_the_same_session_and_the_merge_shows_its_break():
    records = records_with_a_break()
    per_request = trajectory.rebuild(records, "per_request", Outcome.COMPLETED)
    merged = trajectory.rebuild(records, "prefix_merging", Outcome.COMPLETED)
    assert len(per_request) == 4 and len(merged) == 2
    view = trajectory.trajectory_view("t-0000", "prefix_merging", merged, None, None)
    first, second = view["traces"]
    assert first["break_reason"] == "first" and second["break_reason"] == "sub_agent"
    assert second["lineage_id"] == first["trace_id"]
    masks = {tok[1] for tok in first["tokens"]}
    assert masks == {0, 1}  # sampled tokens and the tool results between them
    assert first["sampled_tokens"] == sum(tok[1] for tok in first["tokens"])
    # masked tokens carry no logprob, sampled ones do
    assert all((tok[2] is None) == (tok[1] == 0) for tok in first["tokens"])


def test_trace_tokens_are_decoded_with_versions_and_cut_when_huge(monkeypatch):
    trace = Trace(
        trace_id="s:0",
        prompt_ids=[1, 2],
        response_ids=[10, 11, 12],
        loss_mask=[1, 0, 1],
        response_logprobs=[-0.1, None, -2.0],
        version_spans=[
            VersionSpan(version="3", start=0, end=1),
            VersionSpan(version="4", start=2, end=3),
        ],
    )
    v = trajectory.trace_view(trace, lambda i: f"<{i}>")
    assert v["prompt"]["text"] == "<1><2>"
    assert v["tokens"] == [
        ["<10>", 1, -0.1, "3", 10],
        ["<11>", 0, None, None, 11],
        ["<12>", 1, -2.0, "4", 12],
    ]
    monkeypatch.setattr(trajectory, "MAX_TOKENS", 2)
    cut = trajectory.trace_view(trace, None)
    assert len(cut["tokens"]) == 2 and cut["tokens_cut"] == 1 and cut["tokens"][0][0] == "10"


def test_a_traces_routing_presence_is_marked_per_token_and_summed_up(monkeypatch):
    # 4 prompt + 6 response positions: the prompt's rows from one call, response tokens
    # 1..4 from another; response token 0 (position 4) and the last have none
    segments = [
        RoutingSegment(object="routing/s/0/0", row=0, start=0, length=4, version="1"),
        RoutingSegment(object="routing/s/0/1", row=0, start=5, length=4, version="1"),
    ]
    trace = Trace(
        trace_id="s:0",
        prompt_ids=[1, 2, 3, 4],
        response_ids=[10, 11, 12, 13, 14, 15],
        loss_mask=[1] * 6,
        response_logprobs=[-0.1] * 6,
        routing=TraceRouting(layers=48, top_k=8, dtype="uint8", segments=segments),
    )
    v = trajectory.trace_view(trace, None)["routing"]
    assert v["present"] == [[1, 5]]  # response tokens 1..4: the others are marked
    # 8 positions * 48 layers * 8 experts * 1 byte = 3072 bytes
    assert v["line"] == (
        "routing: 8 of 10 positions (prompt 4 of 4), 48 layers × top-k 8, uint8, 3.0 KiB"
    )
    monkeypatch.setattr(trajectory, "MAX_TOKENS", 3)  # marks only for the tokens shown
    assert trajectory.trace_view(trace, None)["routing"]["present"] == [[1, 3]]
    dense = msgspec.structs.replace(trace, routing=None)
    assert trajectory.trace_view(dense, None)["routing"] == {"line": "routing: none", "present": []}


def test_tokens_that_spell_a_secret_are_hidden_with_their_ids():
    from services.common.redact import Scrubber

    token = "ps_" + "Ab3_" * 10 + "xyz"
    pieces = [
        "Your",
        " key",
        " is",
        " ps",
        "_Ab3",
        "_Ab3" * 9,
        "xyz",
        ".",
        " env:",
        " hunter",
        "2-pass",
        "word!",
    ]
    trace = Trace(
        trace_id="s:0",
        prompt_ids=[0],
        response_ids=list(range(len(pieces))),
        loss_mask=[1] * len(pieces),
        response_logprobs=[-0.5] * len(pieces),
    )
    scrub = Scrubber([token, "hunter2-password"])
    v = trajectory.trace_view(trace, lambda i: pieces[i], scrub)
    shown = [t[0] for t in v["tokens"]]
    assert shown == [
        "Your",
        " key",
        " is",
        "[redacted]",
        "",
        "",
        "",
        ".",
        " env:",
        "[redacted]",
        "",
        "",
    ]
    assert [t[4] for t in v["tokens"]] == [0, 1, 2, None, None, None, None, 7, 8, None, None, None]
    assert all(t[1] == 1 and t[2] == -0.5 for t in v["tokens"])  # mask and logprobs kept
    assert trajectory.trace_view(trace, lambda i: pieces[i])["tokens"][4][0] == "_Ab3"  # no scrub
    assert trajectory.hidden_pieces(["a", "b"], scrub) == set()


def test_session_view_lists_calls_with_timings_tools_and_markup_as_plain_text():
    records = records_with_a_break()
    evil = "<script>alert(1)</script><b>bold</b>"
    reply = {
        "role": "assistant",
        "content": evil,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "sh", "arguments": '{"cmd": "ls"}'},
            }
        ],
    }
    normalized = {"messages": [{"role": "tool", "tool_call_id": "c0", "content": evil}]}
    records[1] = msgspec.structs.replace(
        records[1],
        reply=msgspec.Raw(orjson.dumps(reply)),
        normalized=msgspec.Raw(orjson.dumps(normalized)),
        raw_request=msgspec.Raw(orjson.dumps({"messages": [{"role": "user", "content": evil}]})),
        timings=Timings(received=1.0, upstream_start=1.010, upstream_end=1.210, captured=1.215),
        drift_reason="history_rewritten",
        side_call="title",
    )
    row = SessionRow(
        session_id="t-0000",
        task_id="t",
        state="COMPLETED",
        reward=1.0,
        eval_reason=evil,
        entered={"RUNNING": 0.0, "POSTRUN": 2.0, "COMPLETED": 3.0},
    )
    art = Artifacts(diff="--- a\n+++ b\n" + evil, logs={"agent.log": evil}, harness="shell")
    v = views.session_view(row, list(reversed(records)), [], art, None, now=5.0)
    assert [c["seq"] for c in v["calls"]] == [0, 1, 2, 3]  # in order whatever came first
    c = v["calls"][1]
    assert c["engine_ms"] == 200.0 and c["proxy_ms"] == 15.0
    assert c["side_call"] == "title" and c["drift_reason"] == "history_rewritten"
    assert c["tool_calls"] == [{"id": "c1", "name": "sh", "arguments": '{"cmd": "ls"}'}]
    assert c["tool_results"][0]["content"]["text"] == evil
    assert evil in c["reply"]["text"] and evil in c["request"]["text"]  # data, unescaped:
    # the page puts it in with textContent (the browser test checks it stays text)
    assert c["tokens_in"] == len(views.reconstruct_prompts(records)[1])
    assert v["artifacts"]["logs"]["agent.log"]["text"] == evil
    assert v["verdict"]["eval_reason"] == evil
    assert [s["state"] for s in v["spans"]] == ["RUNNING", "POSTRUN"]


def test_a_judges_call_is_listed_last_and_rebuilt_as_an_untrainable_side_call():
    records = records_with_a_break()  # the harness's calls 0..3
    judged = Trajectory(
        session_id="t-0000", task_id="t", outcome=Outcome.COMPLETED, builder="x", traces=[]
    )
    body = {"model": "judge", "messages": [{"role": "user", "content": "# Rubric ..."}]}
    reply = JudgeReply("SCORE: 7", "judge-7b", "stop")
    records.append(judge_record(judged, 4, body, 1.0, reply))
    row = SessionRow(session_id="t-0000", task_id="t", state="COMPLETED")
    v = views.session_view(row, records, [], Artifacts(), None, now=5.0)
    c = v["calls"][-1]
    assert (c["seq"], c["side_call"], c["tokens_in"], c["tokens_out"]) == (4, "judge", 0, 0)
    assert "SCORE: 7" in c["reply"]["text"] and "# Rubric" in c["request"]["text"]
    for builder in ("per_request", "prefix_merging"):
        traces = trajectory.rebuild(records, builder, Outcome.COMPLETED)
        (side,) = [t for t in traces if t.side_call == "judge"]
        assert not side.trainable and side.completion_seqs == [4]
        assert all(t.trainable for t in traces if t.side_call is None)


def test_the_session_page_shows_each_calls_routing_rows_and_base_only_for_moe_sessions():
    records = records_with_a_break()
    row = SessionRow(session_id="t-0000", task_id="t", state="COMPLETED")
    dense = views.session_view(row, records, [], None, None, now=1.0)
    assert dense["routing"] is False and all(c["routing"] is None for c in dense["calls"])

    def routed(start: int, rows: int, base_seq: int | None) -> RoutedExperts:
        obj = f"routing/t-0000/0/{rows}"
        return RoutedExperts(
            object=obj, start=start, rows=rows, layers=48, top_k=8, dtype="uint8", base_seq=base_seq
        )

    routing = {0: routed(0, 100, None), 1: routed(100, 1234, 0), 3: routed(50, 10, None)}
    moe = [msgspec.structs.replace(r, routing=routing.get(r.seq)) for r in records]
    v = views.session_view(row, moe, [], None, None, now=1.0)
    assert v["routing"] is True
    first, delta, none, fresh = (c["routing"] for c in v["calls"])
    assert first["line"] == "100 rows · 37.5 KiB"  # 100 * 48 * 8 bytes
    assert (delta["rows"], delta["start"], delta["base_seq"]) == (1234, 100, 0)
    assert delta["nbytes"] == 1234 * 48 * 8
    assert delta["line"] == "1,234 rows · 462.8 KiB (delta from #0)"
    assert none is None  # this call's engine returned none: "—" on the page
    assert fresh["line"] == "10 rows · 3.8 KiB (from position 50: none before)"


def replayed_records(diverge_at: int | None = None):
    """records_with_a_break() as a replay of "rec-0007" answered them: calls 0 and 1 from
    the recording (1 with a date that differed), 2 and 3 live; or, diverging at call
    ``diverge_at``, a void call there and one refused after it."""
    records = records_with_a_break()
    marks = {
        0: ReplayMark(session_id="rec-0007", seq=0),
        1: ReplayMark(session_id="rec-0007", seq=1, nondeterministic=["date", "session id"]),
    }
    records = [msgspec.structs.replace(r, replay=marks.get(r.seq)) for r in records]
    if diverge_at is None:
        return records
    why = f"replay of rec-0007 diverged at call {diverge_at}: messages[3].content differs"
    void = dict(output_ids=[], output_logprobs=[], prompt_ids=[], prompt_base_seq=None)
    first, records = records[0], records[:diverge_at]
    mark = ReplayMark(session_id="rec-0007", seq=diverge_at, result="diverged")
    records.append(msgspec.structs.replace(first, seq=diverge_at, error=why, replay=mark, **void))
    refused = f"this replay diverged already: {why}"
    mark = ReplayMark(session_id="rec-0007", seq=diverge_at + 1, result="refused")
    records.append(
        msgspec.structs.replace(first, seq=diverge_at + 1, error=refused, replay=mark, **void)
    )
    return records


def test_a_replays_session_page_says_which_calls_were_replayed_and_how_many_went_live():
    row = SessionRow(session_id="t-0000", task_id="t", state="COMPLETED")
    v = views.session_view(row, replayed_records(), [], None, None, now=1.0)
    assert v["replay_column"] is True
    assert v["replay"] == {
        "of": "rec-0007",
        "replayed": 2,
        "live": 2,
        "diverged_at": None,
        "line": "replay of rec-0007: 2 calls replayed, 2 live",
    }
    first, second, live, _ = (c["replay"] for c in v["calls"])
    assert first["line"] == "replayed #0 of rec-0007" and first["session_id"] == "rec-0007"
    assert second["line"] == "replayed #1 of rec-0007 · nondeterministic: date, session id"
    assert second["nondeterministic"] == ["date", "session id"] and second["seq"] == 1
    assert live is None  # answered by the engine: "—" on the page


def test_a_diverged_replay_names_the_call_it_diverged_at_and_marks_its_row():
    row = SessionRow(session_id="t-0000", task_id="t", state="FAILED")
    v = views.session_view(row, replayed_records(diverge_at=2), [], None, None, now=1.0)
    assert v["replay_column"] is True
    assert v["replay"]["line"] == "replay of rec-0007: 2 calls replayed, 0 live, diverged at call 2"
    assert (v["replay"]["replayed"], v["replay"]["live"], v["replay"]["diverged_at"]) == (2, 0, 2)
    diverged, refused = v["calls"][2], v["calls"][3]
    assert diverged["replay"] == {"kind": "diverged", "session_id": "rec-0007", "line": "diverged"}
    assert diverged["error"].startswith("replay of rec-0007 diverged at call 2: ")  # said once
    assert refused["replay"]["kind"] == "refused"
    # diverged at its first call: no call replayed, still a replay of rec-0007
    at0 = views.replay_summary(replayed_records(diverge_at=0))
    assert at0["line"] == "replay of rec-0007: 0 calls replayed, 0 live, diverged at call 0"


def test_an_ordinary_session_has_no_replay_line_nor_column():
    records = records_with_a_break()
    failed = msgspec.structs.replace(records[0], seq=4, error="engine said 500", output_ids=[])
    row = SessionRow(session_id="t-0000", task_id="t", state="COMPLETED")
    v = views.session_view(row, [*records, failed], [], None, None, now=1.0)
    assert v["replay"] is None and v["replay_column"] is False
    assert all(c["replay"] is None for c in v["calls"])
    assert views.replay_summary(records) is None


def test_task_view_timelines_and_a_group_with_no_variance():
    idx = SessionIndex()
    idx.add_task("t", "shell", 0.0)
    rows = [
        SessionRow(
            session_id=f"t-000{i}",
            task_id="t",
            index=i,
            state="COMPLETED",
            reward=1.0,
            entered={"REGISTERED": 0.0, "INITIALIZING": 1.0, "RUNNING": 2.0 + i, "COMPLETED": 9.0},
        )
        for i in range(3)
    ]
    v = views.task_view("t", None, rows, {}, 0.0, now=10.0)
    assert v["no_variance"] and v["done"] == 3 and not v["live"]
    spans = v["timelines"][1]["spans"]
    assert [(s["phase"], s["start"], s["end"]) for s in spans] == [
        ("queued", 0.0, 1.0),
        ("init", 1.0, 3.0),
        ("running", 3.0, 9.0),
    ]
    rows[0].reward = 0.0
    assert not views.task_view("t", None, rows, {}, 0.0, now=10.0)["no_variance"]


def test_long_text_is_cut_and_says_by_how_much():
    assert views.clip("x" * 10, 4) == {"text": "xxxx", "cut": 6}


def test_a_session_page_settles_once_ended_read_and_its_artifacts_are_here():
    row = SessionRow(session_id="t-0000", task_id="t", state="COMPLETED", synced=False)
    art = Artifacts(harness="shell")
    assert views.session_view(row, [], [], art, None, now=1.0)["settled"] is False  # unread
    row.synced = True
    assert views.session_view(row, [], [], None, None, now=1.0)["settled"] is False  # no artifacts
    assert views.session_view(row, [], [], art, None, now=1.0)["settled"] is True
    row.state = "RUNNING"
    assert views.session_view(row, [], [], art, None, now=1.0)["settled"] is False


def records_with_tool_failures(session_id: str = "t-0001"):
    """One conversation of three tool-offering calls: the first parses, the second's
    JSON is broken at output tokens [2, 5), the third calls a tool that was not offered."""
    rng = random.Random(11)
    cap = Capture(session_id)
    bad = ToolParseFailure(kind="malformed", detail="Expecting value", start=2, end=5)
    unknown = ToolParseFailure(kind="unknown_tool", detail="no tool named 'rm'")
    parses = [
        ToolParse(ok=True, family="qwen3", calls=1),
        ToolParse(ok=False, family="qwen3", failures=[bad]),
        ToolParse(ok=False, family="qwen3", calls=1, failures=[unknown]),
    ]
    prompt = opening(text(rng, 30), text(rng, 20))
    for parse in parses:
        output = text(rng, 10) + [2]
        cap.call(prompt, output, tool_parse=parse)
        prompt = prompt + output + glue_after(output, text(rng, 8))
    return cap.records


def test_tool_call_parse_health_on_the_session_trajectory_and_task_pages():
    records = records_with_tool_failures()
    row = SessionRow(session_id="t-0001", task_id="t", state="COMPLETED")
    v = views.session_view(row, records, [], None, None, now=1.0)
    assert v["tool_parse"] == {
        "parsed": 1,
        "failed": 2,
        "kinds": {"malformed": 1, "unknown_tool": 1},
        "turns": 3,
        "failed_calls": [1, 2],
    }
    call = v["calls"][1]["tool_parse"]  # the span is in the call's output tokens
    assert call["family"] == "qwen3" and (call["parsed"], call["failed"]) == (0, 1)
    assert call["failures"] == [
        {"kind": "malformed", "detail": "Expecting value", "start": 2, "end": 5}
    ]
    assert v["calls"][0]["tool_parse"]["failures"] == []
    # the trajectory viewer: the same failure at its span of the merged trace's response
    (trace,) = trajectory.rebuild(records, "prefix_merging", Outcome.COMPLETED)
    tv = trajectory.trajectory_view("t-0001", "prefix_merging", [trace], None, None)["traces"][0]
    tp = tv["tool_parse"]
    assert (tp["parsed"], tp["failed"], tp["turns"], tp["family"]) == (1, 2, 3, "qwen3")
    first, second = tp["failures"]
    offset = len(views.reconstruct_prompts(records)[1]) - tv["prompt_tokens"]
    assert (first["seq"], first["start"], first["end"]) == (1, offset + 2, offset + 5)
    shown = [tok[4] for tok in tv["tokens"][first["start"] : first["end"]]]
    assert shown == records[1].output_ids[2:5]
    assert (second["seq"], second["kind"], second["start"]) == (2, "unknown_tool", -1)
    # the task page: counts per session from the build's stats, and how many failed
    stats = BuildStats(tool_turns=3, tool_calls_checked=3, tool_calls_failed={"malformed": 2})
    clean = BuildStats(tool_turns=2, tool_calls_checked=4)
    rows = [SessionRow(session_id=f"t-000{i}", task_id="t", index=i) for i in range(3)]
    trajs = {
        "t-0000": Trajectory(
            session_id="t-0000",
            task_id="t",
            outcome=Outcome.COMPLETED,
            builder="x",
            traces=[],
            stats=stats,
        ),
        "t-0001": Trajectory(
            session_id="t-0001",
            task_id="t",
            outcome=Outcome.COMPLETED,
            builder="x",
            traces=[],
            stats=clean,
        ),
    }
    task = views.task_view("t", None, rows, trajs, 0.0, now=1.0)
    assert [m["tool_parse"] for m in task["group"]] == [
        {"parsed": 1, "failed": 2, "kinds": {"malformed": 2}},
        {"parsed": 4, "failed": 0, "kinds": {}},
        None,  # not built yet
    ]
    assert task["tool_parse"] == {
        "parsed": 5,
        "failed": 2,
        "kinds": {"malformed": 2},
        "sessions": 2,
        "sessions_failed": 1,
    }


def test_pages_of_sessions_without_tools_show_no_tool_line():
    records = records_with_a_break()
    row = SessionRow(session_id="t-0000", task_id="t", state="COMPLETED")
    v = views.session_view(row, records, [], None, None, now=1.0)
    assert v["tool_parse"] is None and all(c["tool_parse"] is None for c in v["calls"])
    traces = trajectory.rebuild(records, "per_request", Outcome.COMPLETED)
    view = trajectory.trajectory_view("t-0000", "per_request", traces, None, None)
    assert all(t["tool_parse"] is None for t in view["traces"])


RULE = "session ended error: reward 0 by rule"
NOT_FOUND = "shell exited with code 127: sh: 1: ./agent.sh: not found"


def test_a_failed_sessions_page_and_group_show_why_it_failed():
    """Issue 38.10: the task page's group and the session page gave the evaluator's
    `reward 0 by rule` as the reason; the run's own (and its stderr) was not shown."""
    row = SessionRow(
        session_id="t-0000",
        task_id="t",
        state="ERROR",
        reward=0.0,
        eval_status="ok",
        reason=NOT_FOUND,
        eval_reason=RULE,
        synced=True,
    )
    stderr = "\x1b[33mwarning\x1b[0m: x\n" * 50 + "sh: 1: ./agent.sh: \x1b[1mnot found\x1b[0m\n"
    art = Artifacts(exit_code=127, stderr_tail=stderr, stdout_tail="\x1b[32mok\x1b[0m")
    v = views.session_view(row, [], [], art, None, now=5.0)
    f = v["failure"]
    assert (f["state"], f["reason"], f["eval_reason"], f["exit_code"]) == (
        "ERROR",
        NOT_FOUND,
        RULE,
        127,
    )
    lines = f["stderr"].splitlines()
    assert len(lines) == views.FAILURE_LINES and lines[-1] == "sh: 1: ./agent.sh: not found"
    assert "\x1b" not in v["artifacts"]["stderr_tail"]["text"]
    assert v["artifacts"]["stdout_tail"]["text"] == "ok"
    # its artifacts gone (a restart): the list's copy of stderr's end, said so
    row.exit_code, row.stderr = 127, "sh: 1: ./agent.sh: not found"
    gone = views.session_view(row, [], [], None, None, now=5.0)["failure"]
    assert (gone["exit_code"], gone["stderr"], gone["artifacts"]) == (
        127,
        "sh: 1: ./agent.sh: not found",
        False,
    )
    assert views.group_member(row, None)["reason"] == NOT_FOUND
    ok = SessionRow(session_id="t-0001", task_id="t", state="COMPLETED", eval_reason="passed")
    assert views.session_view(ok, [], [], None, None, now=5.0)["failure"] is None
    assert views.group_member(ok, None)["reason"] == "passed"


def test_a_finished_tasks_timeline_spans_the_task_not_up_to_now_with_an_axis():
    """Issue 38.12: timelines were scaled to now - task start, so a finished task's
    sessions shrank to slivers as time passed; and there was no time axis."""
    rows = [
        SessionRow(
            session_id=f"t-000{i}",
            task_id="t",
            index=i,
            state="COMPLETED",
            synced=True,
            entered={"REGISTERED": 100.0, "RUNNING": 101.0 + i, "COMPLETED": 130.0 + i},
        )
        for i in range(2)
    ]
    v = views.task_view("t", None, rows, {}, 0.0, now=5000.0)
    assert (v["timeline_start"], v["timeline_end"]) == (100.0, 131.0)
    assert [t["label"] for t in v["axis"]] == ["0", "5 s", "10 s", "15 s", "20 s", "25 s", "30 s"]
    assert v["axis"][-1]["at"] <= v["timeline_end"] - v["timeline_start"]
    rows[1].state = "RUNNING"  # a live one: up to now
    rows[1].entered = {"REGISTERED": 100.0, "RUNNING": 101.0}
    live = views.task_view("t", None, rows, {}, 0.0, now=5000.0)
    assert live["timeline_end"] == 5000.0
    assert [t["label"] for t in live["axis"]][:3] == ["0", "15 min", "30 min"]
    assert views.duration(5400) == "1 h 30" and views.duration(90) == "1 min 30 s"


def test_a_side_call_before_the_main_loop_shows_no_later_chain_as_its_lineage():
    """Issue 38.11: a title call made before the main loop was shown as descending from
    the main loop's chain, which began after it."""
    rng = random.Random(3)
    cap = Capture("t-0000")
    cap.call(opening(text(rng, 12), text(rng, 8)), text(rng, 4) + [2], side_call="title")
    agent_loop(cap, rng, 2)
    traces = trajectory.rebuild(cap.records, "prefix_merging", Outcome.COMPLETED)
    view = trajectory.trajectory_view("t-0000", "prefix_merging", traces, None, None)
    by_chain = {t["chain_id"]: t for t in view["traces"]}
    title = next(t for t in view["traces"] if t["side_call"] == "title")
    main = next(t for t in view["traces"] if t["side_call"] is None)
    assert title["lineage_id"] == main["trace_id"]  # as the builder files it
    assert title["lineage"] == {
        "trace_id": main["trace_id"],
        "chain_id": main["chain_id"],
        "later": True,
    }
    assert by_chain[main["chain_id"]]["lineage"] is None
    # a sub-agent's parent began before it: shown as its lineage
    records = records_with_a_break()
    merged = trajectory.trajectory_view(
        "t-0000",
        "prefix_merging",
        trajectory.rebuild(records, "prefix_merging", Outcome.COMPLETED),
        None,
        None,
    )
    assert merged["traces"][1]["lineage"]["later"] is False
