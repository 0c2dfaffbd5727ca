"""Engine backpressure end to end: the real embedded engine's queue, read from its
``/metrics``, makes the runtime pool hold INIT (through ``polar:backpressure`` in a real
Valkey) until the queue drains; sessions then flow as usual."""

import asyncio
import contextlib
import http.server
import threading
import time

import httpx
import pytest

from schemas import Outcome
from schemas import subjects as S
from services.pool.backpressure import EngineWatch
from services.scheduler import logic
from tests.helpers.node import Node, task, wait_until
from tests.helpers.procs import ServiceProcess
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


class _Engine(http.server.BaseHTTPRequestHandler):
    """An engine's HTTP surface: ``/metrics`` with an empty queue, or no such route."""

    has_metrics = True

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.gets += 1
        if self.path == "/metrics" and self.has_metrics:
            body = b"# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs 0\n"
            self.send_response(200)
        else:
            body = b'{"detail":"Not Found"}'
            self.send_response(404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # the test counts the pool's lines, not ours
        pass


@contextlib.contextmanager
def engine_server(has_metrics: bool):
    handler = type("Handler", (_Engine,), {"has_metrics": has_metrics})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.gets = 0
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


async def test_the_pool_polls_quietly_and_drops_an_engine_without_metrics(fresh_servers, tmp_path):
    """The real pool process, polling every 0.05 s an engine with ``/metrics`` and one
    without: the second is asked once and named in one warning; the polls of the first
    add no line to the pool's log."""
    nats_url, redis_url = fresh_servers
    with engine_server(True) as good, engine_server(False) as bare:
        urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in (good, bare)]
        cfg = {
            "nats_url": nats_url,
            "redis_url": redis_url,
            "node": "bp-logs",
            "work_dir": str(tmp_path / "work"),
            "engine_urls": urls,
            "backpressure_poll_seconds": 0.05,
        }
        proc = await asyncio.to_thread(
            ServiceProcess("services.pool.main:create_app", cfg, tmp_path / "logs").start
        )
        try:
            await wait_until(lambda: good.gets >= 40, 20, "40 polls of the engine")
        finally:
            await asyncio.to_thread(proc.stop)
        polls = good.gets
    lines = proc.log.read_text().splitlines()
    about_metrics = [line for line in lines if "metrics" in line]
    assert bare.gets == 1, f"the engine without /metrics was asked {bare.gets} times"
    assert len(about_metrics) == 1, f"{polls} polls gave {len(about_metrics)} lines: {lines[-5:]}"
    assert "WARNING" in about_metrics[0] and urls[1] in about_metrics[0]
    assert "has no /metrics (404)" in about_metrics[0]
