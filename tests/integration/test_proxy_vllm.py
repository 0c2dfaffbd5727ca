"""The proxy in front of a real vLLM (CPU), ``kind: vllm``: the four protocols through
their official SDKs, in token mode (the proxy renders) and chat mode (vLLM renders), every
call captured with ids and logprobs that a teacher-forced recomputation reproduces.

The model has random weights: answers are text of ``max_tokens`` tokens; tool calls are
covered by tests/integration/test_vllm_real.py (structured outputs steer them there).
"""

from __future__ import annotations

import shutil

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types as gt

from schemas.completion import reconstruct_prompts
from services.common.registry import Registry
from services.trainer.sync import push_weights
from tests.helpers.requires import requires_vllm
from tests.helpers.stack import running_session, start_proxy
from tests.helpers.vllm_server import LOGPROB_TOLERANCE as TOLERANCE
from tests.helpers.vllm_server import hf_model, teacher_forced_gap
from tests.integration.proxy_agents import captured, session_url
from tests.unit.engine.tiny import second_checkpoint, tiny_model_dir

# the first test to ask starts vLLM: 2-6 minutes on two loaded cores (pyproject: 300 s)
pytestmark = [requires_vllm, pytest.mark.timeout(900)]
SYSTEM = "You are a coding agent."
ASK = "List the files."
ADMIN_TOKEN = "admin-secret"


@pytest.fixture(scope="module", params=["token", "chat"])
def proxy(request, vllm_engine, nats_url, redis_url, tmp_path_factory):
    backends = [{"name": "cpu-vllm", "kind": "vllm", "url": vllm_engine.url}]
    p = start_proxy(
        nats_url,
        redis_url,
        vllm_engine.url,
        tiny_model_dir(),
        tmp_path_factory.mktemp("plogs"),
        mode=request.param,
        backends=backends,
        admin_token=ADMIN_TOKEN,
    )
    try:
        yield p, request.param
    finally:
        p.stop()


@pytest.fixture(scope="module")
def hf():
    return hf_model(tiny_model_dir())


async def openai_chat(url: str, stream: bool) -> str:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    kw = dict(
        model="m",
        max_tokens=12,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}],
    )
    if stream:
        chunks = [c async for c in await client.chat.completions.create(stream=True, **kw)]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    done = await client.chat.completions.create(**kw)
    return done.choices[0].message.content or ""


async def openai_responses(url: str, stream: bool) -> str:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model="m", instructions=SYSTEM, input=ASK, max_output_tokens=12)
    if stream:  # 12 tokens end in response.incomplete, which the SDK's helper rejects
        events = [e async for e in await client.responses.create(stream=True, **kw)]
        assert events[-1].type == "response.incomplete"
        return "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return (await client.responses.create(**kw)).output_text


async def anthropic_messages(url: str, stream: bool) -> str:
    client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    kw = dict(
        model="claude-x",
        max_tokens=12,
        system=SYSTEM,
        messages=[{"role": "user", "content": ASK}],
    )
    if stream:
        async with client.messages.stream(**kw) as s:
            msg = await s.get_final_message()
    else:
        msg = await client.messages.create(**kw)
    return "".join(b.text for b in msg.content if b.type == "text")


async def gemini(url: str, stream: bool) -> str:
    client = genai.Client(api_key="unused", http_options=gt.HttpOptions(base_url=url))
    config = gt.GenerateContentConfig(system_instruction=SYSTEM, max_output_tokens=12)
    models = client.aio.models
    if stream:
        parts = [
            c.text or ""
            async for c in await models.generate_content_stream(
                model="gemini-x", contents=ASK, config=config
            )
        ]
        return "".join(parts)
    return (await models.generate_content(model="gemini-x", contents=ASK, config=config)).text


PROTOCOLS = {
    "openai_chat": openai_chat,
    "openai_responses": openai_responses,
    "anthropic_messages": anthropic_messages,
    "gemini": gemini,
}


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
async def test_each_protocol_is_captured_token_exact(proxy, protocol, bus, redis_client, hf):
    p, mode = proxy
    (session,) = await running_session(Registry(redis_client), f"vllm-{mode}-{protocol}")
    url = session_url(p.url, session.token)
    texts = [await PROTOCOLS[protocol](url, stream) for stream in (False, True)]
    recs = await captured(bus, session.session_id, expect=2)
    assert len(recs) == 2
    prompts = reconstruct_prompts(recs)
    for rec, text in zip(recs, texts, strict=True):
        prompt = prompts[rec.seq]
        assert rec.mode == mode and rec.protocol.startswith(protocol.split("_")[0])
        assert len(rec.output_ids) == len(rec.output_logprobs) == 12
        assert rec.weight_version is None  # vLLM's "default": no version set yet
        gap = teacher_forced_gap(hf, prompt, list(rec.output_ids), list(rec.output_logprobs))
        print(f"{mode} {protocol}: teacher-forced max |diff| {gap:.2e}")
        assert gap < TOLERANCE
        assert isinstance(text, str)  # random weights: the text may be all whitespace


async def test_the_trainers_weight_sync_reloads_vllm_from_the_checkpoint_dir(
    proxy, vllm_engine, bus, redis_client
):
    """services/trainer/sync.py's push, as the trainer makes it after a step: the proxy
    reloads vLLM from the dir (collective_rpc reload_weights), and the next call's record
    carries the new version and the new weights' logprobs."""
    p, mode = proxy
    served = vllm_engine.model_dir
    trained = hf_model(second_checkpoint())
    shutil.copytree(second_checkpoint(), served, dirs_exist_ok=True)
    try:
        async with httpx.AsyncClient() as client:
            version = await push_weights(
                client, p.url, str(served), f"step-{mode}", admin_token=ADMIN_TOKEN
            )
        assert version == f"step-{mode}"
        (session,) = await running_session(Registry(redis_client), f"vllm-sync-{mode}")
        await openai_chat(session_url(p.url, session.token), False)
        (rec,) = await captured(bus, session.session_id, expect=1)
        assert rec.weight_version == f"step-{mode}"
        prompt = reconstruct_prompts([rec])[rec.seq]
        gap = teacher_forced_gap(trained, prompt, list(rec.output_ids), list(rec.output_logprobs))
        print(f"{mode}: after the sync, teacher-forced (trained weights) max |diff| {gap:.2e}")
        assert gap < TOLERANCE
    finally:  # the session's server back to the weights and "no version" it started with
        shutil.copytree(tiny_model_dir(), served, dirs_exist_ok=True)
        async with httpx.AsyncClient(base_url=vllm_engine.url, timeout=60) as engine:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(served)}}
            (await engine.post("/collective_rpc", json=rpc)).raise_for_status()
            await engine.post("/reset_prefix_cache")
            await engine.post("/update_weight_version", json={"new_version": "default"})
