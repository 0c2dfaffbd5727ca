"""Dedupe of anonymous task messages (no task_id, no Nats-Msg-Id): the plain parts."""

import orjson
from hypothesis import given
from hypothesis import strategies as st

from schemas import TaskRequest
from services.scheduler import logic
from services.scheduler.config import SchedulerConfig

RAW = orjson.dumps({"instruction": "x", "num_samples": 2})


def parsed(raw: bytes = RAW) -> TaskRequest:
    task = logic.parse_submission(raw, max_bytes=10_000)
    assert isinstance(task, TaskRequest)
    return task


def test_only_tasks_nothing_names_are_deduped_by_payload():
    anonymous = parsed()
    named = parsed(orjson.dumps({"task_id": "t9", "instruction": "x"}))
    assert logic.needs_payload_dedupe(anonymous, None)
    assert logic.needs_payload_dedupe(anonymous, "bad id!")  # unusable as a task id
    assert not logic.needs_payload_dedupe(anonymous, "msg-1")
    assert not logic.needs_payload_dedupe(named, None)


def test_fresh_id_is_used_only_when_nothing_else_names_the_task():
    task = parsed()
    assert logic.with_task_id(task, None, "t-fresh").task_id == "t-fresh"
    assert logic.with_task_id(task, "msg-1", "t-fresh").task_id == "msg-1"
    named = parsed(orjson.dumps({"task_id": "t9", "instruction": "x"}))
    assert logic.with_task_id(named, "msg-1", "t-fresh").task_id == "t9"


def test_digest_is_of_the_exact_bytes():
    same = orjson.dumps({"instruction": "x", "num_samples": 2})
    reordered = orjson.dumps({"num_samples": 2, "instruction": "x"})
    assert logic.payload_digest(RAW) == logic.payload_digest(same)
    assert logic.payload_digest(RAW) != logic.payload_digest(reordered)


def test_message_task_id_is_stable_per_message_and_distinct_across_messages():
    d = logic.payload_digest(RAW)
    one = logic.message_task_id(d, 7, 1000.25)
    assert one == logic.message_task_id(d, 7, 1000.25)  # a redelivery: the same task
    assert one != logic.message_task_id(d, 8, 1000.25)
    assert one != logic.message_task_id(d, 7, 1000.5)
    assert one != logic.message_task_id(logic.payload_digest(b"{}"), 7, 1000.25)
    assert one.startswith("t-") and logic.usable_msg_id(one)


def test_a_copy_within_the_window_joins_the_first_one():
    first = logic.FirstCopy("t-first", 1000.0)
    assert logic.join_first(None, logic.FirstCopy("t-a", 1000.0), 120).task_id == "t-a"
    assert logic.join_first(first, logic.FirstCopy("t-b", 1119.9), 120) is first
    assert logic.join_first(first, logic.FirstCopy("t-c", 990.0), 120) is first  # out of order
    late = logic.FirstCopy("t-d", 1120.5)
    assert logic.join_first(first, late, 120) is late  # after the window: a new task
    assert logic.join_first(first, late, 0) is late


def test_first_copy_round_trips_and_tolerates_garbage():
    c = logic.FirstCopy("t-0123456789abcdef", 1712345678.123456)
    assert logic.FirstCopy.parse(c.encode()) == c
    for bad in (None, b"", b"just-an-id", b"id notanumber", b"a b c", b"\xff\xfe"):
        assert logic.FirstCopy.parse(bad) is None


@given(st.floats(min_value=0, max_value=1e9, allow_nan=False), st.integers(1, 2**40))
def test_first_copy_round_trip_any_time(ts, seq):
    c = logic.FirstCopy(logic.message_task_id("d", seq, ts), ts)
    assert logic.FirstCopy.parse(c.encode()) == c


def test_record_outlives_the_window():
    assert logic.dedupe_ttl(120) == 240
    assert logic.dedupe_ttl(0.2) == 1
    assert SchedulerConfig().submit_dedupe_seconds == 120.0
