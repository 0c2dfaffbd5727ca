"""Reading a session's completion records (``read_completions``, the builder's and the
dashboard's) on real JetStream: a session of a few calls is read one request per record,
without the ephemeral consumer a longer one still gets for what is past the first reads."""

from __future__ import annotations

import asyncio
import random
import uuid

import msgspec
import pytest

from schemas import encode
from schemas import subjects as S
from services.common import completions
from services.common.completions import read_completions
from tests.unit.builder.synth import Capture, agent_loop

pytestmark = pytest.mark.asyncio


async def published(bus, n: int) -> tuple[str, list[int]]:
    """A new session with ``n`` records (another session's between them); their seqs."""
    sid, other = f"rd-{uuid.uuid4().hex[:8]}-0000", f"rd-{uuid.uuid4().hex[:8]}-0001"
    cap = Capture(sid)
    agent_loop(cap, random.Random(n), n)
    for rec in cap.records:
        await bus.publish(S.completions(sid), encode(rec), msg_id=f"c:{sid}:{rec.seq}")
        noise = msgspec.structs.replace(rec, session_id=other)
        await bus.publish(S.completions(other), encode(noise), msg_id=f"c:{other}:{rec.seq}")
    return sid, [r.seq for r in cap.records]


async def consumers_made(bus, read) -> tuple[object, int]:
    """``read()``'s result, and how many consumers it asked the server to create."""
    made: list[str] = []

    async def seen(msg) -> None:
        made.append(msg.subject)

    sub = await bus.nc.subscribe(f"$JS.API.CONSUMER.CREATE.{S.STREAM_COMPLETIONS}.>", cb=seen)
    try:
        got = await read()
        await bus.nc.flush()
        await asyncio.sleep(0.05)
    finally:
        await sub.unsubscribe()
    return got, len(made)


async def test_a_few_records_are_read_without_a_consumer(bus):
    sid, seqs = await published(bus, 3)
    (records, problems), made = await consumers_made(bus, lambda: read_completions(bus, sid))
    assert [r.seq for r in records] == seqs and problems == []
    assert {r.session_id for r in records} == {sid}
    assert made == 0


async def test_many_records_past_the_first_reads_come_by_one_consumer(bus):
    n = completions.DIRECT_READS + 12
    sid, seqs = await published(bus, n)
    (records, problems), made = await consumers_made(bus, lambda: read_completions(bus, sid))
    assert [r.seq for r in records] == seqs and problems == []  # none twice, none missed
    assert {r.session_id for r in records} == {sid}
    assert made == 1


async def test_exactly_the_direct_reads_need_no_consumer(bus):
    sid, seqs = await published(bus, completions.DIRECT_READS)
    (records, _), made = await consumers_made(bus, lambda: read_completions(bus, sid))
    assert [r.seq for r in records] == seqs and made == 0


async def test_an_unreadable_record_is_a_problem_not_an_error(bus):
    sid, seqs = await published(bus, 2)
    await bus.publish(S.completions(sid), b"not a record", msg_id=f"c:{sid}:bad")
    records, problems = await read_completions(bus, sid)
    assert [r.seq for r in records] == seqs
    assert len(problems) == 1 and "unreadable" in problems[0]
