"""The proxy's admin API passing the engine's own control through, on real processes.

* Against the real embedded engine: ``/admin/pause_generation``, ``/continue_generation``
  and ``/flush_cache`` reach the engine (a paused engine holds calls, a busy one refuses
  to flush and the refusal comes back as a JSON error), under the admin token; the
  topology's ``pause_mode: in_place`` reaches it too (the engine's default would abort
  the call in flight).
* A generation the engine paused across a weight swap names both versions and where the
  second began (the SGLang client carries ``meta_info.weight_versions``).
* Against a vLLM replay server (recorded response shapes): the topology's
  ``settings.reload_path`` makes ``/admin/update_weights`` reach the deployment's reload
  endpoint; a missing endpoint is a clear 501.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from proxy.backends.base import BackendError, ChatRequest, SamplingParams
from proxy.backends.sglang import SGLangBackend
from tests.fixtures.backends.backend_replay import ReplayServer, fixture_reply, reply_json
from tests.helpers.stack import new_session, proxy_process, start_proxy
from tests.integration.proxy_agents import ChatAgent, captured, run_loop
from tests.unit.engine.tiny import second_checkpoint, tiny_model_dir

pytestmark = pytest.mark.asyncio
ADMIN = {"authorization": "Bearer admin-secret"}
SLOW = [{"role": "user", "content": "SLOW REPLY please"}]
IN_PLACE = {"pause_mode": "in_place"}  # the engine's default (abort) would cut calls off


@pytest.fixture(scope="module")
def proxy(engine, nats_url, redis_url, tmp_path_factory):
    # as `polar up` passes topology.yaml's backends (which override `backend`)
    topology = [{"name": "cpu", "kind": "embedded", "url": engine.url, "settings": IN_PLACE}]
    log_dir = tmp_path_factory.mktemp("p")
    with proxy_process(
        nats_url, redis_url, engine, log_dir, admin_token="admin-secret", backends=topology
    ) as p:
        yield p


async def post(url: str, **kw) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as c:
        return await c.post(url, **kw)


async def get(url: str, **kw) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.get(url, **kw)


async def until_refused(url: str) -> httpx.Response:
    """Flush until the engine refuses: the call is in the engine then (how long it takes
    to get there depends on the machine's load; an earlier flush is harmless)."""
    for _ in range(400):
        answer = await post(url + "/admin/flush_cache", headers=ADMIN)
        if answer.status_code != 200:
            return answer
        await asyncio.sleep(0.02)
    raise AssertionError("the call never reached the engine")


async def test_engine_control_passes_through_to_the_embedded_engine(
    proxy, engine, redis_client, bus
):
    slow_s, new_s = (
        await new_session(redis_client, "eng-a"),
        await new_session(redis_client, "eng-b"),
    )
    sdk = openai.AsyncOpenAI(base_url=f"{proxy.url}/s/{slow_s.token}/v1", api_key="x")
    slow = asyncio.create_task(
        sdk.chat.completions.create(model="m", messages=SLOW, max_tokens=1500)
    )
    refused = await until_refused(proxy.url)  # busy: the engine's own refusal, as JSON
    assert refused.status_code == 400
    assert refused.json() == {
        "ok": False,
        "error": f"{engine.url}: Cache not flushed: requests are queued or running.",
        "kind": "bad_request",
        "worker": engine.url,
    }

    assert (await post(proxy.url + "/admin/pause_generation")).status_code == 401
    paused = await post(proxy.url + "/admin/pause_generation", headers=ADMIN)
    assert (paused.status_code, paused.json()) == (200, {"ok": True})
    waiting = asyncio.create_task(run_loop(ChatAgent(proxy.url, new_s.token), 1))
    done, _ = await asyncio.wait({slow, waiting}, timeout=1.5)
    assert not done  # the engine holds both: the running call in place, the new one queued
    assert (await post(proxy.url + "/admin/flush_cache", headers=ADMIN)).status_code == 400

    assert (await post(proxy.url + "/admin/continue_generation")).status_code == 401
    resumed = await post(proxy.url + "/admin/continue_generation", headers=ADMIN)
    assert (resumed.status_code, resumed.json()) == (200, {"ok": True})
    answer = await asyncio.wait_for(slow, 60)
    (step,) = await asyncio.wait_for(waiting, 60)
    assert step.call is not None
    # paused in place, not aborted: the whole answer, on the same weights
    (rec,) = await captured(bus, slow_s.session_id, expect=1)
    assert len(rec.output_ids) == 1500 and answer.choices[0].finish_reason == "length"
    assert len(await captured(bus, new_s.session_id, expect=1)) == 1

    flushed = await post(proxy.url + "/admin/flush_cache", headers=ADMIN)  # idle now
    assert (flushed.status_code, flushed.json()) == (200, {"ok": True})
    # the proxy's own gate was never paused by any of this
    assert (await get(proxy.url + "/admin/weight_version", headers=ADMIN)).status_code == 200


# -- vLLM: settings from the topology reach the client ------------------------------------
def vllm_replay(server: ReplayServer) -> None:
    """A vLLM 0.32.0 server (recorded bodies) with a deployment's /reload endpoint."""
    for method, path, rel in (
        ("GET", "/version", "version.json"),
        ("GET", "/v1/models", "models.json"),
        ("POST", "/inference/v1/generate", "generate_tokens.json"),
        ("POST", "/pause", "pause.json"),
        ("POST", "/update_weight_version", "update_weight_version.json"),
        ("POST", "/reset_prefix_cache", "reset_prefix_cache.json"),
    ):
        server.add(method, path, fixture_reply(f"vllm/0.32.0/{rel}"))
    server.add("GET", "/health", reply_json(None))
    server.add("POST", "/reload", reply_json({"success": True}))

    def weight_info(_rec):  # the version last set, as vLLM's /weight_info reports it
        sets = server.calls("POST", "/update_weight_version")
        return reply_json({"weight_version": sets[-1].json()["new_version"] if sets else "step-7"})

    server.add("GET", "/weight_info", weight_info)


async def test_vllm_weight_update_through_the_proxy_uses_the_topology_reload_path(
    nats_url, redis_url, tmp_path
):
    server = ReplayServer()
    url = await server.start()
    vllm_replay(server)
    topology = [
        {
            "name": "gpu0",
            "kind": "vllm",
            "url": url,
            "settings": {"reload_path": "/reload", "pause_mode": "keep"},
        }
    ]
    # started in a thread: the replay server answers the proxy's start-up probe from here
    p = await asyncio.to_thread(
        start_proxy,
        nats_url,
        redis_url,
        url,
        tiny_model_dir(),
        tmp_path,
        admin_token="admin-secret",
        backends=topology,
    )
    try:
        body = {"model_path": "/ckpt/step-8", "version": "step-8"}
        answer = await post(p.url + "/admin/update_weights", json=body, headers=ADMIN)
        assert (answer.status_code, answer.json()) == (
            200,
            {"ok": True, "weight_version": "step-8"},
        )
        assert [c.json() for c in server.calls("POST", "/reload")] == [
            {"model_path": "/ckpt/step-8", "weight_version": "step-8"}
        ]
        assert server.calls("POST", "/update_weight_version")[0].json() == {"new_version": "step-8"}
        version = await get(p.url + "/admin/weight_version", headers=ADMIN)
        assert version.json() == {"weight_version": "step-8"}

        paused = await post(p.url + "/admin/pause_generation", headers=ADMIN)
        assert paused.json() == {"ok": True}
        assert server.calls("POST", "/pause")[-1].query == {"mode": ["keep"]}
        # this server has no /resume: a clear 501 naming what is missing
        missing = await post(p.url + "/admin/continue_generation", headers=ADMIN)
        assert missing.status_code == 501
        err = missing.json()
        assert (err["ok"], err["kind"], err["worker"]) == (False, "unsupported", url)
        assert "/resume" in err["error"] and "VLLM_SERVER_DEV_MODE" in err["error"]
    finally:
        await asyncio.to_thread(p.stop)
        await server.stop()


# -- a request that spans a weight swap says so -------------------------------------------
async def test_a_generation_paused_across_a_swap_names_both_versions(engine):
    """Last of the embedded tests: the engine serves the second checkpoint afterwards."""
    b = SGLangBackend(engine.url, pause_mode="in_place")
    try:
        req = ChatRequest(
            session_id="span", messages=SLOW, sampling=SamplingParams(max_new_tokens=1500)
        )
        call = asyncio.create_task(b.chat(req))
        for _ in range(400):  # until the call is in the engine (it refuses to flush then)
            try:
                await b.flush_cache()
            except BackendError:
                break
            await asyncio.sleep(0.02)
        before = await b.weight_version()
        await b.pause()
        assert await b.update_weights_from_disk(str(second_checkpoint()), "span-2") == "span-2"
        await b.resume()
        gen = await asyncio.wait_for(call, 60)
    finally:
        await b.aclose()
    assert gen.weight_versions == [before, "span-2"] and gen.weight_version == "span-2"
    start, switch = gen.weight_version_starts
    assert start == 0 and 0 < switch < len(gen.output_ids) == 1500
