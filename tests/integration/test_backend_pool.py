"""Worker pool over real HTTP: affinity, fail-over, health, re-admission, control fan-out.

Each worker is a replay server answering SGLang-shaped ``/generate`` and control calls;
which worker served a request is read from ``Generation.worker``.
"""

from __future__ import annotations

from collections import Counter
from urllib.parse import urlsplit

import pytest

from proxy.backends.base import BackendCapabilityError, BackendError, ErrorKind, TokenRequest
from proxy.backends.factory import make_pool
from proxy.backends.pool import BackendPool
from schemas.completion import UpstreamMode
from tests.fixtures.backends.backend_replay import (
    ReplayServer,
    Reply,
    fixture_reply,
    load_fixture,
    reply_json,
)

SESSIONS = [f"sess-{i}" for i in range(30)]
V = "sglang/0.5.13"


def generate_route(version: str = "default"):
    body = load_fixture(f"{V}/generate.json")["body"]

    def route(rec):
        meta = {
            **body["meta_info"],
            "prompt_tokens": len(rec.json()["input_ids"]),
            "weight_version": version,
        }
        return reply_json({**body, "meta_info": meta})

    return route


def worker_routes(server: ReplayServer, version: str = "default") -> None:
    server.add("GET", "/health", Reply())
    server.add("POST", "/generate", generate_route(version))
    server.add(
        "GET",
        "/model_info",
        reply_json({**load_fixture(f"{V}/model_info.json")["body"], "weight_version": version}),
    )
    server.add("GET", "/server_info", fixture_reply(f"{V}/server_info.json"))
    for path in ("/pause_generation", "/continue_generation", "/flush_cache"):
        server.add("POST", path, reply_json({"status": "ok"}))


@pytest.fixture
async def workers():
    servers = [ReplayServer() for _ in range(3)]
    urls = []
    for server in servers:
        worker_routes(server)
        urls.append(await server.start())
    pools: list[BackendPool] = []

    def pool(**kw) -> BackendPool:
        p = make_pool("sglang", urls, modes=(UpstreamMode.TOKEN,), **kw)
        pools.append(p)
        return p

    yield servers, urls, pool
    for p in pools:
        await p.aclose()
    for server in servers:
        await server.stop()


async def served_by(pool: BackendPool) -> dict[str, str]:
    out = {}
    for session in SESSIONS:
        gen = await pool.generate(TokenRequest(session_id=session, input_ids=[1, 2, 3]))
        out[session] = gen.worker
    return out


async def test_sessions_stick_to_one_worker_and_spread_over_all(workers):
    _, urls, make = workers
    pool = make()
    await pool.probe()
    first = await served_by(pool)
    assert await served_by(pool) == first == {s: pool.worker_for(s) for s in SESSIONS}
    assert set(Counter(first.values())) == set(urls)


async def test_dead_worker_moves_only_its_sessions(workers):
    servers, urls, make = workers
    pool = make()
    await pool.probe()
    before = await served_by(pool)
    dead = urls[0]
    await servers[0].stop()
    after = await served_by(pool)
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == dead} and moved
    assert dead not in after.values()
    assert pool.failovers == 1  # the first request to hit the dead worker; then it is down
    assert pool.healthy() == urls[1:]


async def test_a_503_fails_over_without_taking_the_worker_out(workers):
    servers, urls, make = workers
    pool = make()
    await pool.probe()
    session = next(s for s in SESSIONS if pool.worker_for(s) == urls[0])
    servers[0].add("POST", "/generate", fixture_reply("sglang/0.5.3rc2/generate_unavailable.json"))
    gen = await pool.generate(TokenRequest(session_id=session, input_ids=[1, 2, 3]))
    assert gen.worker != urls[0] and pool.failovers == 1
    assert pool.healthy() == urls and pool.worker_for(session) == urls[0]


async def test_health_checks_take_a_worker_out_and_bring_it_back(workers):
    servers, urls, make = workers
    pool = make(failure_threshold=2)
    await pool.probe()
    port = urlsplit(urls[1]).port
    await servers[1].stop()
    await pool.check_health()
    assert urls[1] in pool.healthy()  # one miss is tolerated
    await pool.check_health()
    assert urls[1] not in pool.healthy()
    revived = ReplayServer()
    worker_routes(revived)
    await revived.start(port)
    try:
        await pool.check_health()
        assert pool.healthy() == urls
        assert {s: pool.worker_for(s) for s in SESSIONS} == await served_by(pool)
    finally:
        await revived.stop()


async def test_a_returning_worker_gets_the_pool_weights_before_it_serves(workers):
    servers, urls, make = workers
    for server in servers:
        server.add(
            "POST", "/update_weights_from_disk", reply_json({"success": True, "message": "ok"})
        )
        server.add("GET", "/model_info", reply_json({"weight_version": "step-2"}))
    pool = make()
    await pool.probe()
    await pool.pause()
    assert await pool.update_weights_from_disk("/ckpt/step-2", "step-2") == "step-2"
    port = urlsplit(urls[2]).port
    await servers[2].stop()
    pool.mark_down(urls[2], "test")
    revived = ReplayServer()
    worker_routes(revived, version="default")  # restarted with its original weights
    answers = [reply_json({"weight_version": "default"}), reply_json({"weight_version": "step-2"})]
    revived.add("GET", "/model_info", answers)
    revived.add("POST", "/update_weights_from_disk", reply_json({"success": True, "message": "ok"}))
    await revived.start(port)
    try:
        await pool.check_health()
        assert urls[2] in pool.healthy()
        [update] = revived.calls("POST", "/update_weights_from_disk")
        assert update.json() == {"model_path": "/ckpt/step-2", "weight_version": "step-2"}
        assert revived.calls("POST", "/pause_generation")  # the pool is paused, so is it
    finally:
        await revived.stop()


async def test_control_reaches_every_worker_and_names_the_one_that_fails(workers):
    servers, urls, make = workers
    pool = make()
    await pool.probe()
    await pool.pause()
    await pool.flush_cache()
    await pool.resume()
    for server in servers:
        assert [r.path for r in server.requests if r.method == "POST"] == [
            "/generate",  # the probe's one-token request
            "/pause_generation",
            "/flush_cache",
            "/continue_generation",
        ]
    servers[1].add("POST", "/flush_cache", Reply(400, b"Flush cache failed.\n", "text/plain"))
    with pytest.raises(BackendError) as err:
        await pool.flush_cache()
    assert err.value.worker == urls[1] and urls[1] in err.value.message
    servers[0].add("GET", "/model_info", reply_json({"weight_version": "other"}))
    with pytest.raises(BackendError, match="disagree"):
        await pool.weight_version()


async def test_probe_refuses_if_any_worker_refuses_and_skips_unreachable_ones(workers):
    servers, urls, make = workers
    await servers[2].stop()
    caps = await make().probe()
    assert caps.workers == 2 and caps.token_mode is True
    body = load_fixture(f"{V}/generate.json")["body"]
    servers[1].add("POST", "/generate", reply_json({**body, "meta_info": {}}))
    with pytest.raises(BackendCapabilityError):
        await make().probe()


async def test_no_healthy_worker_is_unavailable(workers):
    servers, _, make = workers
    pool = make()
    await pool.probe()
    for server in servers:
        await server.stop()
    req = TokenRequest(session_id="s", input_ids=[1])
    for healthy_left in (1, 0):  # each request tries at most two workers
        with pytest.raises(BackendError) as err:
            await pool.generate(req)
        assert err.value.kind is ErrorKind.UNAVAILABLE and len(pool.healthy()) == healthy_left
    with pytest.raises(BackendError, match="no healthy worker"):
        await pool.generate(req)
