"""MoE routing (R3) through the real stack: the embedded engine serving a tiny random
Qwen3-MoE (tests/helpers/moe_model.py, Qwen3's real vocabulary and template) in token
mode behind the proxy process with ``routed_experts: true``, real NATS (the object store
holds the rows) and Valkey; a tool-using agent loop of the OpenAI SDK
(tests/fixtures/policies/tool_loop.yaml: the engine emits the script's tokens through
its forward, so its routing and logprobs are the model's).

Checked from what a trainer gets:

* every call carried routing; later calls store only the rows past their base's;
* the prefix-merged chain's routing, read back from the object store, is the model's own
  routing of the whole sequence at every position but the last (transformers' routers);
* transformers with the captured routing replayed scores every sampled token as the
  engine did, and with the experts shifted it does not (the replay is what decides);
* ``polar export --layout slime`` writes that routing as the row's ``.npy``;
* after a weight update the engine routes the whole prompt again: the next call stores
  every row, under the new version, and its trace's routing is the new weights' own;
* a proxy asked for routing on a dense model refuses to start, saying why.
"""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import orjson
import pytest
import redis.asyncio as aioredis
import torch

from schemas import Outcome, Trajectory, encode
from schemas import subjects as S
from schemas.routing import routing_array
from services.common.bus import Bus
from services.common.registry import Registry
from services.engine.weights import load_tensors, save_tensors
from services.export.export import export
from services.trainer.routing_replay import replay_routing
from tests.helpers.moe_model import MOE_LAYERS, hf_model, hf_pass, moe_model_dir, picked_logprobs
from tests.helpers.routing_session import routed_chain
from tests.helpers.stack import POLICIES, EmbeddedServer, running_session, start_proxy
from tests.integration.proxy_agents import ChatAgent, run_loop, tool_output

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir():
    return moe_model_dir()


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("moe-engine")
    srv = EmbeddedServer(model_dir, policy=POLICIES / "tool_loop.yaml", log_dir=log_dir).wait()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def proxy(engine, model_dir, nats_url, redis_url, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("moe-proxy")
    p = start_proxy(nats_url, redis_url, engine.url, model_dir, log_dir, routed_experts=True)
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def hf(model_dir):
    return hf_model(model_dir)


async def exported_routing(bus: Bus, session, chain, tmp_path) -> np.ndarray:
    """The chain stored as a scored trajectory, exported as slime rows: its .npy."""
    traj = Trajectory(
        session_id=session.session_id,
        task_id=session.task_id,
        outcome=Outcome.COMPLETED,
        builder="prefix_merging",
        traces=[chain],
        reward=1.0,
        eval_status="ok",
    )
    await bus.js.publish(S.trajectories(session.task_id), encode(traj))
    stats = await export(bus, tmp_path / "rows.jsonl", layout="slime", task_id=session.task_id)
    [row] = [orjson.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert stats.rows == 1 and row["rollout_routed_experts"].endswith(".npy")
    return np.load(tmp_path / row["rollout_routed_experts"])


async def test_a_tool_loops_routing_reaches_the_trainer_exactly(
    proxy, hf, nats_url, redis_url, tmp_path
):
    client = aioredis.from_url(redis_url)
    bus = await Bus.open(nats_url, "test-moe-routing", declare=False)
    try:
        [session] = await running_session(Registry(client), "moe-routing")
        steps = await run_loop(ChatAgent(proxy.url, session.token), turns=4)
        records, chain, blobs = await routed_chain(bus, session.session_id, len(steps))
        exported = await exported_routing(bus, session, chain, tmp_path)
    finally:
        await bus.close()
        await client.aclose()

    assert len(records) == len(steps) == 4 and all(r.routing is not None for r in records)
    first, *later = (r.routing for r in records)
    assert first.start == 0 and first.base_seq is None
    assert (first.layers, first.top_k, first.dtype) == (len(MOE_LAYERS), 2, "uint8")
    # each later call extends the one before: it stores only the rows past its base's
    assert [r.base_seq for r in later] == [0, 1, 2] and all(r.start > 0 for r in later)
    assert sum(r.rows for r in later) < sum(r.start for r in later)

    tokens = chain.prompt_ids + chain.response_ids
    n = len(tokens)
    assert chain.completion_seqs == [0, 1, 2, 3] and n == chain.routing.covered + 1
    experts, present = routing_array(chain.routing, n, blobs)
    assert present[: n - 1].all() and not present[n - 1]
    assert exported.dtype == np.int32 and np.array_equal(exported, experts[: n - 1])

    # the model's own routing of the whole sequence (one uncached pass) is what was stored
    _, own, _ = hf_pass(hf, [tokens])
    assert np.array_equal(experts[: n - 1], own[0, : n - 1].numpy())

    # replayed, transformers scores every sampled token as the engine did
    sampled = [i for i, m in enumerate(chain.loss_mask) if m]
    engine_lp = torch.tensor([chain.response_logprobs[i] for i in sampled])
    start = len(chain.prompt_ids)

    def scored(routing: np.ndarray) -> torch.Tensor:
        with replay_routing(hf, torch.from_numpy(routing).long()):
            logprobs, _, _ = hf_pass(hf, [tokens])
        return picked_logprobs(logprobs[0], tokens, start)[sampled]

    assert (scored(experts) - engine_lp).abs().max().item() <= 1e-4
    shifted = np.where(experts >= 0, (experts + 1) % 8, experts)  # other experts, same shape
    assert (scored(shifted) - engine_lp).abs().max().item() > 1e-2


async def test_after_a_weight_update_every_row_is_stored_again_under_the_new_version(
    proxy, engine, model_dir, nats_url, redis_url, tmp_path
):
    """Runs last in this module: it leaves the engine on other weights."""
    tensors = load_tensors(model_dir)
    g = torch.Generator().manual_seed(7)
    for layer in MOE_LAYERS:  # another router: the same tokens routed elsewhere
        name = f"model.layers.{layer}.mlp.gate.weight"
        tensors[name] = tensors[name] + 0.5 * torch.randn(tensors[name].shape, generator=g)
    updated = tmp_path / "updated"
    shutil.copytree(model_dir, updated)
    save_tensors(tensors, updated)

    client = aioredis.from_url(redis_url)
    bus = await Bus.open(nats_url, "test-moe-update", declare=False)
    try:
        [session] = await running_session(Registry(client), "moe-update")
        agent = ChatAgent(proxy.url, session.token)
        for i in range(2):
            await agent.step(stream=False)
            agent.add_result(tool_output(i, last=False))
        async with httpx.AsyncClient(base_url=engine.url, timeout=120) as http:
            body = {"model_path": str(updated), "weight_version": "2"}
            (await http.post("/update_weights_from_disk", json=body)).raise_for_status()
        await agent.step(stream=False)
        records, chain, blobs = await routed_chain(bus, session.session_id, 3)
    finally:
        await bus.close()
        await client.aclose()

    before, after = records[1].routing, records[2].routing
    assert before.base_seq == 0 and records[2].weight_version == "2"
    assert after.base_seq is None and after.start == 0  # its prefix, routed again: all new
    assert {s.version for s in chain.routing.segments} == {"2"}
    tokens = chain.prompt_ids + chain.response_ids
    experts, present = routing_array(chain.routing, len(tokens), blobs)
    assert present[:-1].all()
    _, own, _ = hf_pass(hf_model(updated), [tokens])
    assert np.array_equal(experts[:-1], own[0, :-1].numpy())


def test_routing_on_a_dense_model_refuses_the_start(tmp_path):
    from proxy.config import ProxyConfig
    from proxy.main import routing_capture
    from schemas import UpstreamMode
    from tests.unit.engine.tiny import tiny_model_dir

    dense = ProxyConfig(model_dir=str(tiny_model_dir()), routed_experts=True)
    with pytest.raises(ValueError, match="config.json names no experts"):
        routing_capture(dense, UpstreamMode.TOKEN, None)
    moe = ProxyConfig(model_dir=str(moe_model_dir()), routed_experts=True, mode="chat")
    with pytest.raises(ValueError, match="needs token mode"):
        routing_capture(moe, UpstreamMode.CHAT, None)
    assert (
        routing_capture(ProxyConfig(model_dir=str(moe_model_dir())), UpstreamMode.TOKEN, None)
        is None
    )
