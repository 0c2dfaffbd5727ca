"""The scheduler keeps serving across a NATS server restart (kill -9, same port and
JetStream store): its connection reconnects forever and its consumers resume."""

import asyncio
import os
import signal
import uuid

import orjson
import pytest

from infra import localservers
from schemas import subjects as S
from services.common.bus import Bus
from services.common.host import ServiceHost
from services.scheduler.config import SchedulerConfig
from services.scheduler.handlers import Scheduler
from services.scheduler.main import consumers
from tests.helpers.node import wait_until

pytestmark = pytest.mark.asyncio


async def publish_retrying(bus: Bus, subject: str, payload: bytes, timeout: float = 15.0):
    """A client's publish while its connection may still be reconnecting."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await bus.js.publish(subject, payload, timeout=2)
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


def task(task_id: str, n: int) -> bytes:
    return orjson.dumps({"task_id": task_id, "instruction": "x", "num_samples": n})


def kill9(proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


async def test_scheduler_serves_tasks_after_nats_restart(redis_url, tmp_path):
    port = localservers.free_port()
    url = f"nats://127.0.0.1:{port}"
    nats = localservers.start_nats(port, tmp_path / "nats")
    cfg = SchedulerConfig(nats_url=url, redis_url=redis_url, reconcile_interval_seconds=0.5)
    host = ServiceHost("scheduler", cfg)
    client = None
    try:
        await host.start()
        for c in consumers(Scheduler(host.bus, host.registry, cfg)):
            host.consume(c)
        client = await Bus.open(url, "test-client", declare=False)
        reg = host.registry
        before, after = f"nrs-{uuid.uuid4().hex[:8]}", f"nrs-{uuid.uuid4().hex[:8]}"

        async def served(task_id: str, n: int) -> bool:
            return len(await reg.task_session_ids(task_id)) == n

        await client.js.publish(S.TASKS_SUBMIT, task(before, 2))
        await wait_until(lambda: served(before, 2), 15, "the first tasks served")

        kill9(nats)
        await wait_until(lambda: _nats_down(host), 15, "the service to see NATS gone")
        await asyncio.sleep(2.5)  # down longer than a consumer's idle fetch (2 s)
        nats = localservers.start_nats(port, tmp_path / "nats")  # same port, same store

        ack = await publish_retrying(client, S.TASKS_SUBMIT, task(after, 3))
        await wait_until(lambda: served(after, 3), 15, "a task after the restart served")
        # The same durable (kept in the file store) delivered it. An ack sent just before
        # the kill -9 may be lost: that message comes back after ack_wait and is a
        # duplicate by task_id, so only "nothing left undelivered" is asserted here.
        info = await client.js.consumer_info(S.STREAM_TASKS, S.CONSUMER_SCHEDULER_SUBMIT)
        assert info.delivered.stream_seq >= ack.seq and info.num_pending == 0
        assert await served(before, 2)
        health = await host.health()
        assert health["nats"] is True and health["workers"] is True
    finally:
        if client is not None:
            await client.close()
        await host.stop()
        localservers.stop_process(nats.pid)


async def _nats_down(host: ServiceHost) -> bool:
    return (await host.health())["nats"] is False
