"""The shared consumer loop against real NATS JetStream: long handlers are kept alive."""

import asyncio
import uuid

import pytest
from nats.js.api import StorageType, StreamConfig

from services.common.bus import ensure_streams, work_consumer
from services.common.consumer import Consumer

pytestmark = pytest.mark.asyncio

ACK_WAIT = 1.0
HANDLER_SECONDS = 3.5  # well past ack_wait: JetStream would redeliver without in_progress


class NoKeepalive(Consumer):
    """The same loop without ``in_progress``: shows the test can see a redelivery."""

    async def _keepalive(self, msg) -> None:
        await asyncio.Event().wait()


async def run_long_job(bus, consumer_cls: type[Consumer]) -> tuple[list[int], object]:
    name = f"TEST_KA_{uuid.uuid4().hex[:8].upper()}"
    await ensure_streams(
        bus.js, (StreamConfig(name=name, subjects=[f"{name}.>"], storage=StorageType.FILE),)
    )
    deliveries: list[int] = []
    done = asyncio.Event()

    async def slow(msg) -> None:
        deliveries.append(msg.metadata.num_delivered)
        await asyncio.sleep(HANDLER_SECONDS)
        done.set()

    await bus.js.publish(f"{name}.job", b"long job")
    cfg = work_consumer("slow", f"{name}.job", ack_wait=ACK_WAIT, max_deliver=5)
    c = consumer_cls(bus, name, cfg, slow, concurrency=4)
    # Not drain mode: the loop keeps pulling while the handler runs, as a service does,
    # so a redelivery would reach a second handler.
    running = asyncio.create_task(c.run())
    await asyncio.wait_for(done.wait(), 20)
    await asyncio.sleep(2 * ACK_WAIT)  # a late redelivery would show up here
    c.stop()
    await asyncio.wait_for(running, 20)
    info = await bus.js.consumer_info(name, "slow")
    await bus.js.delete_stream(name)
    return deliveries, info


async def test_handler_longer_than_ack_wait_is_not_redelivered(bus):
    deliveries, info = await run_long_job(bus, Consumer)
    assert deliveries == [1]
    assert info.num_redelivered == 0 and info.num_ack_pending == 0
    assert info.delivered.consumer_seq == 1 and info.ack_floor.consumer_seq == 1


async def test_without_keepalive_the_same_job_is_redelivered(bus):
    deliveries, _ = await run_long_job(bus, NoKeepalive)
    assert len(deliveries) >= 2 and deliveries[:2] == [1, 2]
