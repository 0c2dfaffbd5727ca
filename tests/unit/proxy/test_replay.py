"""Replay's decisions without a stack: a recorded call answered again as the harness was
told it (its tool call ids too), a changed request refused with the call and field, a
nondeterministic one answered and named, a recorded failure failed again; and the CLI's
task and report (services/cli/replay.py)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import orjson
import pytest

from proxy.capture import normalized_json
from proxy.replay import ReplayDiverged, ReplayedFailure, Replays
from schemas import CompletionRecord, Protocol, ReplaySpec, Session, TaskRequest, UpstreamMode
from schemas.completion import ReplayMark
from services.cli.replay import replay_report, replay_task

SYSTEM = "You are a careful coding agent. Today's date is 2026-12-06."
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
CALL = {
    "id": "call_7f3a",
    "type": "function",
    "function": {"name": "bash", "arguments": '{"command": "ls"}'},
}


def messages(system: str = SYSTEM, *more: dict) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": "fix it"}, *more]


def record(seq: int, msgs: list[dict], reply: dict | None, **kw) -> CompletionRecord:
    return CompletionRecord(
        session_id="orig-0000",
        seq=seq,
        protocol=Protocol.OPENAI_CHAT,
        mode=UpstreamMode.TOKEN,
        model="m",
        normalized=msgspec.Raw(normalized_json(msgs, TOOLS)),
        reply=msgspec.Raw(orjson.dumps(reply) if reply is not None else b"null"),
        **kw,
    )


FIRST = {"role": "assistant", "content": "Looking.", "tool_calls": [CALL]}
RAW = b'{"model": "polar-tiny", "temperature": 0.7, "max_tokens": 512, "messages": []}'
LAST = {"role": "assistant", "content": "Done."}
RESULT = {"role": "tool", "tool_call_id": "call_7f3a", "content": "calc.py tests"}
RECORDS = {
    0: record(
        0,
        messages(),
        FIRST,
        prompt_ids=[1, 2, 3],
        output_ids=[4, 5],
        output_logprobs=[-0.1, -0.2],
        finish_reason="tool_calls",
        raw_request=msgspec.Raw(RAW),
    ),
    1: record(
        1,
        messages(SYSTEM, FIRST, RESULT),
        LAST,
        prompt_ids=[6, 7],
        prompt_base_seq=0,
        prompt_base_len=5,
        output_ids=[8],
        output_logprobs=[-0.3],
        raw_request=msgspec.Raw(RAW),
    ),
}
SPEC = ReplaySpec(session_id="orig-0000")


def replays() -> Replays:
    r = Replays(bus=None)  # the records are kept as if read from the stream
    r.keep(SPEC, dict(RECORDS))
    return r


# the model's name is not compared (a replay may name another); the sampler's settings are
CTX = SimpleNamespace(
    session_id="replay-0000", attempt=0, raw_request=RAW.replace(b"polar-tiny", b"other")
)


async def test_a_recorded_call_is_answered_as_the_harness_was_told_it():
    r = replays()
    first = await r.answer(CTX, normalized_json(messages(), TOOLS), [], SPEC, 0)
    assert first.gen.output_ids == [4, 5] and first.gen.output_logprobs == [-0.1, -0.2]
    assert first.plan.prompt_ids == [1, 2, 3] and first.plan.extends is None
    assert first.turn.text == "Looking." and first.turn.finish_reason == "tool_calls"
    assert [c.id for c in first.turn.tool_calls] == ["call_7f3a"]  # the harness sends it back
    assert first.mark == ReplayMark(session_id="orig-0000", seq=0)
    second = await r.answer(
        CTX, normalized_json(messages(SYSTEM, FIRST, RESULT), TOOLS), [], SPEC, 1
    )
    assert second.plan.prompt_ids == [1, 2, 3, 4, 5, 6, 7]  # the full recorded prompt


async def test_a_date_that_moved_on_is_answered_and_named():
    r = replays()
    tomorrow = normalized_json(messages(SYSTEM.replace("06", "07")), TOOLS)
    first = await r.answer(CTX, tomorrow, [], SPEC, 0)
    assert first.gen.output_ids == [4, 5] and first.mark.nondeterministic == ["date"]


async def test_an_edited_request_diverges_at_its_call_and_field_and_stays_diverged():
    r = replays()
    edited = normalized_json(messages("You are a hasty agent."), TOOLS)
    with pytest.raises(ReplayDiverged) as exc:
        await r.answer(CTX, edited, [], SPEC, 0)
    assert exc.value.status == 409 and exc.value.mark.result == "diverged"
    assert "diverged at call 0:" in exc.value.report
    assert "messages[0].content: recorded 'You are a careful" in exc.value.report
    assert "careful" in exc.value.report and "hasty" in exc.value.report
    same = normalized_json(messages(), TOOLS)  # even the recorded request now
    with pytest.raises(ReplayDiverged, match="this replay diverged already") as exc:
        await r.answer(CTX, same, [], SPEC, 0)
    assert exc.value.mark.result == "refused"


async def test_a_harness_that_samples_otherwise_diverges_at_the_parameter():
    hotter = SimpleNamespace(**{**vars(CTX), "raw_request": RAW.replace(b"0.7", b"1.0")})
    with pytest.raises(ReplayDiverged) as exc:
        await replays().answer(hotter, normalized_json(messages(), TOOLS), [], SPEC, 0)
    assert "sampling.temperature: recorded '0.7', now '1.0'" in exc.value.report


async def test_a_call_past_the_record_and_a_recorded_failure():
    r = replays()
    with pytest.raises(ReplayDiverged, match="the recorded attempt made 2 calls"):
        await r.answer(CTX, normalized_json(messages(), TOOLS), [], SPEC, 2)
    failed = {**RECORDS, 1: record(1, messages(), None, error="engine unavailable: 503")}
    r = Replays(bus=None)
    r.keep(SPEC, failed)
    with pytest.raises(ReplayedFailure, match="engine unavailable") as exc:
        await r.answer(CTX, normalized_json(messages(), TOOLS), [], SPEC, 1)
    assert exc.value.status == 503 and exc.value.mark.result == "failed"


def test_the_replay_task_is_the_recorded_one_once_without_retries():
    spec = TaskRequest(
        task_id="calc",
        instruction="fix",
        num_samples=8,
        early_stop=4,
        max_retries=2,
        metadata={"k": 1},
    )
    session = Session(
        session_id="calc-0003", task_id="calc", index=3, token="t", attempt=1, seq_floor=5
    )
    task = replay_task(spec, session, until=2, train=False)
    assert task.task_id.startswith("replay-") and task.instruction == "fix"
    assert (task.num_samples, task.early_stop, task.max_retries, task.infra_retries) == (
        1,
        None,
        0,
        0,
    )
    assert task.replay == ReplaySpec(session_id="calc-0003", attempt=1, seq_floor=5, until=2)
    assert task.metadata == {"k": 1, "replay_of": "calc-0003"}


def test_the_report_reads_the_replays_own_records():
    mark = ReplayMark(session_id="o", seq=0)
    records = [
        msgspec.structs.replace(RECORDS[0], seq=0, replay=mark),
        msgspec.structs.replace(
            RECORDS[1],
            seq=1,
            replay=msgspec.structs.replace(mark, seq=1, nondeterministic=["duration"]),
        ),
        record(2, messages(), LAST, output_ids=[9]),
    ]
    report = replay_report(records)
    assert (report.replayed, report.live, report.diverged) == (2, 1, None)
    assert report.lines() == [
        "replayed 2 call(s) from the record",
        "then 1 live call(s) from the engine",
        "call 1: differed only by duration (nondeterministic)",
    ]
    diverged = replay_report(
        [
            record(
                0,
                messages(),
                None,
                error="replay of o diverged at call 0: x",
                replay=ReplayMark(session_id="o", seq=0, result="diverged"),
            )
        ]
    )
    assert diverged.diverged == "replay of o diverged at call 0: x" and diverged.replayed == 0


async def test_the_replays_own_session_and_task_ids_read_as_the_recorded_ones():
    """A CLI writes its working directory, named after its session, into its prompt."""
    r = replays()
    ctx = SimpleNamespace(session_id="replay-9f2c1a-0000", attempt=0, raw_request=RAW)
    recorded = messages(SYSTEM + " cwd: /work/sessions/orig-0000-a0-main")
    r.keep(
        SPEC,
        {
            **RECORDS,
            0: msgspec.structs.replace(
                RECORDS[0], normalized=msgspec.Raw(normalized_json(recorded, TOOLS))
            ),
        },
    )
    now = normalized_json(
        messages(SYSTEM + " cwd: /work/sessions/replay-9f2c1a-0000-a0-main"), TOOLS
    )
    first = await r.answer(ctx, now, [], SPEC, 0)
    assert first.mark.nondeterministic == ["session id"]
