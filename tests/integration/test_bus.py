"""Streams and consumers declared in code are applied to existing ones at every start."""

import dataclasses
import uuid

import pytest
from nats.js.api import StorageType, StreamConfig

from schemas import subjects as S
from services.common.bus import CLAIM_THRESHOLD, ensure_consumer, ensure_streams, work_consumer
from services.common.jspub import JetStreamPublisher

pytestmark = pytest.mark.asyncio


def stream(name: str, **kw) -> StreamConfig:
    return StreamConfig(name=name, storage=StorageType.FILE, **kw)


async def test_changed_stream_config_updates_the_existing_stream(bus):
    name = f"TEST_BUS_{uuid.uuid4().hex[:8].upper()}"
    first = stream(name, subjects=[f"{name}.a.>"], max_age=3600.0, duplicate_window=60.0)
    await ensure_streams(bus.js, (first,))
    await bus.js.publish(f"{name}.a.x", b"kept")
    changed = stream(
        name,
        subjects=[f"{name}.a.>", f"{name}.b.>"],
        max_age=7200.0,
        duplicate_window=120.0,
        max_msgs=1000,
    )
    for _ in range(2):  # every start applies it again: idempotent
        await ensure_streams(bus.js, (changed,))
        info = await bus.js.stream_info(name)
        assert sorted(info.config.subjects) == [f"{name}.a.>", f"{name}.b.>"]
        assert info.config.max_age == 7200.0 and info.config.duplicate_window == 120.0
        assert info.config.max_msgs == 1000
        assert info.state.messages == 1  # updated in place, not recreated
    ack = await bus.js.publish(f"{name}.b.y", b"new subject")
    assert ack.stream == name
    await bus.js.delete_stream(name)


async def test_changed_consumer_config_updates_the_existing_durable(bus):
    name = f"TEST_CON_{uuid.uuid4().hex[:8].upper()}"
    await ensure_streams(bus.js, (stream(name, subjects=[f"{name}.>"]),))
    durable = "test-durable"
    await ensure_consumer(
        bus.js, name, work_consumer(durable, f"{name}.a", ack_wait=30.0, max_deliver=5)
    )
    changed = work_consumer(durable, f"{name}.b", ack_wait=12.0, max_deliver=9, max_ack_pending=50)
    for _ in range(2):  # idempotent
        await ensure_consumer(bus.js, name, changed)
        info = await bus.js.consumer_info(name, durable)
        assert info.config.ack_wait == 12.0 and info.config.max_deliver == 9
        assert info.config.max_ack_pending == 50 and info.config.filter_subject == f"{name}.b"
    # The updated durable delivers by its new filter.
    await bus.js.publish(f"{name}.a", b"old filter")
    await bus.js.publish(f"{name}.b", b"new filter")
    sub = await bus.js.pull_subscribe_bind(durable, name)
    [msg] = await sub.fetch(1, timeout=2)
    assert msg.data == b"new filter"
    await msg.ack()
    await sub.unsubscribe()
    await bus.js.delete_stream(name)


async def test_one_object_store_handle_serves_every_claim_check(bus):
    """``Bus.blobs`` asks the server for the store once, not per trajectory or claim."""
    store = await bus.blobs()
    assert await bus.blobs() is store
    big = b"x" * (CLAIM_THRESHOLD + 1)
    sub = await bus.nc.subscribe("polar.tasks.bus-claim")
    await bus.publish("polar.tasks.bus-claim", big, msg_id=f"claim-{uuid.uuid4().hex}")
    assert await bus.payload(await sub.next_msg(timeout=5)) == big
    await sub.unsubscribe()


async def test_send_stores_through_the_lean_publisher_and_deduplicates(bus):
    subject = S.session_event("RUNNING")
    before = (await bus.js.stream_info(S.STREAM_EVENTS)).state.messages
    await bus.send(subject, b"first", msg_id="bus-send-lean:1")
    await bus.send(subject, b"again", msg_id="bus-send-lean:1")  # a retry: not stored twice
    assert (await bus.js.stream_info(S.STREAM_EVENTS)).state.messages == before + 1
    assert bus.lean is not None and bus.lean.unsupported is None  # it went the lean way


async def test_send_falls_back_to_nats_py_when_the_lean_publisher_cannot_publish(bus):
    # A lean client that cannot reach its server (as during a NATS restart, when it fails
    # at once): the message goes through nats-py, which waits out a reconnect, instead
    # of failing the hand-off.
    dead = JetStreamPublisher(
        "nats://127.0.0.1:1", name="dead", fallback=bus.publish, fallback_above=CLAIM_THRESHOLD
    )
    cut_off = dataclasses.replace(bus, lean=dead)
    subject = S.session_event("RUNNING")
    before = (await bus.js.stream_info(S.STREAM_EVENTS)).state.messages
    await cut_off.send(subject, b"through nats-py", msg_id="bus-send-fallback:1")
    assert (await bus.js.stream_info(S.STREAM_EVENTS)).state.messages == before + 1
    await dead.aclose()
