"""The shared consumer loop against real NATS JetStream: long handlers are kept alive; a
message that kills its process is quarantined."""

import asyncio
import contextlib
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

    async def _keepalive(self) -> None:
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


async def test_a_registry_outage_does_not_use_up_max_deliver(bus, tmp_path):
    """The handler reads a Valkey that is down for 3 s (killed, started again on its
    AOF): it is run again in place until the registry is back, so the message is handled
    once and not dead-lettered (before: 2 deliveries failed within 1 s, then the dead-
    letter stream; a READY hand-off lost that way left its session READY forever)."""
    import redis.asyncio as aioredis

    from infra import localservers
    from schemas import subjects as S

    port = localservers.free_port()
    valkey = localservers.start_valkey(port, tmp_path / "valkey")
    client = aioredis.from_url(f"redis://127.0.0.1:{port}/0")
    name = f"TEST_OUT_{uuid.uuid4().hex[:8].upper()}"
    await ensure_streams(
        bus.js, (StreamConfig(name=name, subjects=[f"{name}.>"], storage=StorageType.FILE),)
    )
    dead = await bus.nc.subscribe(S.dead_letter(name))
    handled: list[int] = []

    async def reads_the_registry(msg) -> None:
        await client.set("outage-test", b"1")
        handled.append(msg.metadata.num_delivered)

    try:
        await client.set("outage-test", b"0")
        valkey.kill()
        valkey.wait(10)
        await bus.js.publish(f"{name}.job", b"job")
        cfg = work_consumer("outage", f"{name}.job", ack_wait=ACK_WAIT, max_deliver=2)
        c = Consumer(bus, name, cfg, reads_the_registry, concurrency=1)
        running = asyncio.create_task(c.run(drain=True))
        await asyncio.sleep(3.0)
        valkey = localservers.start_valkey(port, tmp_path / "valkey")
        await asyncio.wait_for(running, 40)
        assert handled == [1]  # once, on its first delivery
        with pytest.raises(asyncio.TimeoutError):
            await dead.next_msg(timeout=0.5)
    finally:
        await dead.unsubscribe()
        await client.aclose()
        await bus.js.delete_stream(name)
        localservers.stop_process(valkey.pid)


async def test_a_message_that_kills_its_process_is_quarantined_not_its_neighbours(bus, nats_url):
    """The consumer runs in a process of its own, started again whenever it dies. One
    message ends the process whenever it is handled; three slow ones are in flight beside
    it at each of its first three deaths. From the third death on, each is run alone (one
    such suspect at a time): the killer dies alone and is quarantined at its fourth death
    (dead-lettered, ``on_quarantine`` told); the slow ones, never alone at a death, are
    handled (issue 33: before, all four died with the process up to ``max_deliver`` times,
    then JetStream dropped them)."""
    import sys

    from schemas import subjects as S

    name = f"TEST_Q_{uuid.uuid4().hex[:8].upper()}"
    await ensure_streams(
        bus.js, (StreamConfig(name=name, subjects=[f"{name}.>"], storage=StorageType.FILE),)
    )
    done = await bus.nc.subscribe(f"sig.{name}.done")
    quarantined = await bus.nc.subscribe(f"sig.{name}.quarantined")
    dead = await bus.nc.subscribe(S.dead_letter(name))
    await bus.js.publish(f"{name}.work", b"poison")
    for _ in range(3):
        await bus.js.publish(f"{name}.work", b"slow:1.5")
    command = [sys.executable, "-m", "tests.helpers.dying_consumer", nats_url, name]
    proc, deaths, handled = None, 0, 0
    try:
        async with asyncio.timeout(300):  # a bound for a hang: the deaths are what count
            while handled < 3 or not quarantined.pending_msgs:
                if proc is None or proc.returncode is not None:
                    deaths += proc is not None
                    assert deaths <= 5, f"the consumer's process died {deaths} times"
                    proc = await asyncio.create_subprocess_exec(*command)
                with contextlib.suppress(TimeoutError):
                    await done.next_msg(timeout=0.2)
                    handled += 1
        assert deaths == 4 and handled == 3
        assert (await quarantined.next_msg(timeout=1)).data == b"poison"
        msg = await dead.next_msg(timeout=10)
        assert msg.data == b"poison"
        assert msg.headers["Polar-Reason"] == (
            "quarantined: its process died 4 times while handling it, the last time running alone"
        )
        assert proc.returncode is None  # it serves on
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        for sub in (done, quarantined, dead):
            await sub.unsubscribe()
        await bus.js.delete_stream(name)
