"""Engine backpressure end to end: the real embedded engine's queue, read from its
``/metrics``, makes the runtime pool hold INIT (through ``polar:backpressure`` in a real
Valkey) until the queue drains; sessions then flow as usual."""

import asyncio
import time

import httpx
import pytest

from schemas import Outcome
from schemas import subjects as S
from services.pool.backpressure import EngineWatch
from services.scheduler import logic
from tests.helpers.node import Node, task, wait_until
from tests.helpers.stack import embedded_engine

pytestmark = pytest.mark.asyncio
QUEUED = 4  # requests parked in the paused engine: above HIGH


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with embedded_engine("shell_agent.yaml", tmp_path_factory.mktemp("engine-logs")) as srv:
        yield srv


async def test_pool_backs_off_init_while_the_engine_queue_is_long(engine, fresh_servers, tmp_path):
    node = await Node.start(*fresh_servers, tmp_path / "work", max_init=2, ready_buffer=1)
    watch = EngineWatch(node.registry.redis, [engine.url], high=2, low=0, ttl_seconds=2)

    async def watching() -> None:  # what the pool service runs every poll period
        while True:
            await watch.poll()
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watching())
    async with httpx.AsyncClient(base_url=engine.url, timeout=60) as http:
        try:
            r = await http.post("/pause_generation", json={"mode": "in_place"})
            assert r.status_code == 200
            body = {"text": ["hello"] * QUEUED, "sampling_params": {"max_new_tokens": 2}}
            parked = asyncio.create_task(http.post("/generate", json=body))
            await wait_until(lambda: watch.backing_off, 10, "the pool to see the queue")
            assert watch.queues == [QUEUED]
            assert await node.registry.redis.exists(S.KEY_BACKPRESSURE)

            spec = task("bp", 3, agent={"command": "true"})
            sids = [s.session_id for s in await node.scheduler.accept(logic.with_task_id(spec))]
            await asyncio.sleep(1.5)  # several dispatch rounds: none may admit
            states = {(await node.registry.get_session(sid)).state for sid in sids}
            assert states == {"REGISTERED"} and len(node.pool.queue) == 3

            assert (await http.post("/continue_generation")).status_code == 200
            resumed_at = time.time()
            assert (await parked).status_code == 200
            await wait_until(lambda: not watch.backing_off, 10, "the queue to drain")
            assert not await node.registry.redis.exists(S.KEY_BACKPRESSURE)
            await node.wait_finished(3, timeout=60)
            assert {f.outcome for f in node.finished.values()} == {Outcome.COMPLETED}
            inits = [e for e in await node.events() if e.to_state == "INITIALIZING"]
            assert len(inits) == 3 and all(e.ts >= resumed_at for e in inits)
        finally:
            watcher.cancel()
            await watch.close()
            await http.post("/continue_generation")
            await node.stop()


async def test_an_engine_without_a_signal_never_blocks_init(fresh_servers, tmp_path):
    """An engine down (or one with no queue gauge) gives no signal: INIT goes on."""
    node = await Node.start(*fresh_servers, tmp_path / "work")
    watch = EngineWatch(node.registry.redis, ["http://127.0.0.1:9"], high=0, low=0, ttl_seconds=2)
    try:
        assert await watch.poll() is False and watch.queues == [None]
        spec = task("bp-none", 2, agent={"command": "true"})
        await node.scheduler.accept(logic.with_task_id(spec))
        await node.wait_finished(2, timeout=30)
    finally:
        await watch.close()
        await node.stop()
