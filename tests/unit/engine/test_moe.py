"""Mixture of experts in the embedded engine (Qwen3-MoE), its routing capture, and the
trainer's routing replay, against transformers' Qwen3MoeForCausalLM as the truth."""

from __future__ import annotations

import base64
import json
import time

import numpy as np
import pytest
import torch
from litestar.testing import TestClient

from services.common.tokenization import ChatTokenizer
from services.engine.app import create_app
from services.engine.config import ServeConfig
from services.engine.engine import Engine, EngineConfig, RequestRejected
from services.engine.model import CausalLM
from services.engine.modelconfig import parse_config
from services.engine.sampling import SamplingParams
from services.engine.sequence import GenerationRequest
from services.engine.weights import load_model, load_tensors
from services.trainer.routing_replay import RoutingReplayError, moe_routers, replay_routing
from tests.helpers.moe_model import MOE_LAYERS, hf_model, hf_pass, moe_model_dir, picked_logprobs

transformers = pytest.importorskip("transformers")

LAYERS, TOP_K = len(MOE_LAYERS), 2


@pytest.fixture(scope="module")
def moe_dir():
    return moe_model_dir()


@pytest.fixture(scope="module")
def moe(moe_dir) -> CausalLM:
    return load_model(moe_dir)


@pytest.fixture(scope="module")
def moe_tok(moe_dir):
    return ChatTokenizer.load(moe_dir)


@pytest.fixture(scope="module")
def engine(moe, moe_tok):
    engine = Engine(moe, moe_tok.decode, moe_tok.eos_token_ids, EngineConfig()).start()
    yield engine
    engine.stop()


def request(prompt, rid="r", routed=True, **params) -> GenerationRequest:
    params = {"ignore_eos": True, **params}
    return GenerationRequest(
        rid=rid,
        prompt_ids=list(prompt),
        params=SamplingParams(**params),
        return_routed_experts=routed,
    )


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151000, (n,), generator=g).tolist()


def engine_routing(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """The rows one uncached forward over ``ids`` records."""
    cache = model.new_cache()
    model.forward([ids], [cache])
    return cache.routed().clone()


@pytest.fixture(scope="module")
def sampled(engine):
    """One engine generation with routing: 20 prompt tokens, 16 sampled."""
    result = engine.submit(request(prompt_ids(20, seed=5), max_new_tokens=16, sampling_seed=3))
    return result.result(timeout=60)


def test_forward_and_routing_equal_transformers(moe, moe_dir):
    """Teacher-forced logprobs of a ragged batch (and of a sequence computed in two cached
    chunks) equal transformers' forward; the recorded experts are its routers' top-k, for
    every position and MoE layer, highest weight first."""
    assert moe.config.moe is not None and moe.config.moe.layers == MOE_LAYERS
    hf = hf_model(moe_dir)
    seqs = [prompt_ids(n, seed) for n, seed in ((33, 1), (12, 2), (1, 3))]
    caches = [moe.new_cache() for _ in seqs]
    ours = moe.forward(seqs, caches, all_logits=True)
    for seq, logits, cache in zip(seqs, ours, caches, strict=True):
        truth, rows, _ = hf_pass(hf, [seq])
        assert (torch.log_softmax(logits, -1) - truth[0]).abs().max().item() <= 1e-4
        assert cache.routed().shape == (len(seq), LAYERS, TOP_K)
        assert torch.equal(cache.routed().long(), rows[0])
    chunked = moe.new_cache()
    moe.forward([seqs[0][:20]], [chunked])
    moe.forward([seqs[0][20:]], [chunked])
    assert torch.equal(chunked.routed(), caches[0].routed())
    # the engine's teacher-forced logprobs (the trainer's math) agree too
    tf = moe.sequence_logprobs([seqs[0]], [5])[0]
    truth = picked_logprobs(hf_pass(hf, [seqs[0]])[0][0], seqs[0], 5)
    assert (tf - truth).abs().max().item() <= 1e-4


def test_fused_expert_tensors_and_qwen_config_keys(moe, moe_dir):
    """Experts stored as transformers' fused 3-D tensors load as the per-expert ones do;
    Qwen's ``num_experts`` and ``decoder_sparse_step`` pick the MoE layers as transformers
    does."""
    tensors = load_tensors(moe_dir)
    for layer in MOE_LAYERS:
        p = f"model.layers.{layer}.mlp.experts."
        per = [
            [tensors.pop(f"{p}{e}.{w}_proj.weight") for w in ("gate", "up", "down")]
            for e in range(8)
        ]
        tensors[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in per])
        tensors[p + "down_proj"] = torch.stack([d for _, _, d in per])
    fused = CausalLM(moe.config, tensors)
    ids = prompt_ids(10, seed=8)
    assert torch.equal(
        fused.forward([ids], [fused.new_cache()])[0], moe.forward([ids], [moe.new_cache()])[0]
    )
    raw = json.loads((moe_dir / "config.json").read_text())
    raw.pop("num_local_experts")
    raw |= {
        "num_experts": 8,
        "num_hidden_layers": 6,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    assert parse_config(raw).moe.layers == (1, 5)
    assert parse_config({**raw, "num_experts": 0}).moe is None


def test_generate_returns_rows_and_a_prefix_hit_keeps_them(engine, moe, sampled):
    """Rows for prompt + output - 1 positions, each the experts of a fresh forward; a
    request extending the first reuses its cache and returns the same rows for the shared
    positions; no flag, no rows; an aborted request has all its rows."""
    first = sampled
    n = len(first.prompt_ids) + len(first.output_ids) - 1
    assert first.routed_experts.shape == (n, LAYERS, TOP_K)
    assert first.routed_experts.dtype == torch.int32
    everything = first.prompt_ids + first.output_ids
    assert torch.equal(first.routed_experts, engine_routing(moe, everything[:-1]))
    truth = moe.teacher_forced_logprobs(everything, len(first.prompt_ids))
    assert max(abs(a - b) for a, b in zip(truth, first.output_logprobs, strict=True)) <= 1e-4

    follow = everything + prompt_ids(5, seed=9)
    second = engine.submit(request(follow, max_new_tokens=6, sampling_seed=4)).result(timeout=60)
    assert second.cached_tokens == n
    rows = second.routed_experts
    assert rows.shape == (len(follow) + len(second.output_ids) - 1, LAYERS, TOP_K)
    assert torch.equal(rows[:n], first.routed_experts)
    assert torch.equal(rows, engine_routing(moe, (follow + second.output_ids)[:-1]))

    plain = engine.submit(request(follow, routed=False, max_new_tokens=2)).result(timeout=60)
    assert plain.routed_experts is None
    # every row or none: an abort between steps has them all, a request for nothing none
    before = engine.stats()["generated_tokens"]
    long = engine.submit(request(prompt_ids(7, 13), rid="long", max_new_tokens=400))
    wait_for(lambda: engine.stats()["generated_tokens"] > before + 3)
    engine.abort("long").result(timeout=10)
    aborted = long.result(timeout=10)
    assert aborted.finish_reason["type"] == "abort"
    everything = aborted.prompt_ids + aborted.output_ids
    assert torch.equal(aborted.routed_experts, engine_routing(moe, everything[:-1]))
    nothing = engine.submit(request([5, 6, 7], max_new_tokens=0)).result(timeout=10)
    assert nothing.routed_experts is None


def test_rows_after_a_weight_swap_are_the_new_weights(moe, moe_tok):
    """A request paused in place across a swap continues on the new weights with its cache
    recomputed: every row it returns is the new router's (which routes differently), and
    the tokens after the swap have the new weights' logprobs."""
    tensors = load_tensors(moe_model_dir())
    g = torch.Generator().manual_seed(7)
    for layer in MOE_LAYERS:
        name = f"model.layers.{layer}.mlp.gate.weight"
        tensors[name] = tensors[name] + 0.3 * torch.randn(tensors[name].shape, generator=g)
    new = CausalLM(moe.config, tensors)
    engine = Engine(moe, moe_tok.decode, moe_tok.eos_token_ids, EngineConfig()).start()
    try:
        future = engine.submit(request(prompt_ids(12, 11), max_new_tokens=200, sampling_seed=1))
        wait_for(lambda: engine.stats()["generated_tokens"] >= 5)
        engine.pause("in_place").result(timeout=10)
        assert engine.swap_weights(new).result(timeout=10) == ("2", 1)
        engine.resume().result(timeout=10)
        result = future.result(timeout=60)
    finally:
        engine.stop()
    assert result.weight_versions == ["1", "2"]
    split = result.weight_version_starts[1]
    everything = result.prompt_ids + result.output_ids
    new_rows = engine_routing(new, everything[:-1])
    assert not torch.equal(new_rows, engine_routing(moe, everything[:-1]))
    assert torch.equal(result.routed_experts, new_rows)
    truth = new.teacher_forced_logprobs(everything, len(result.prompt_ids) + split)
    after = result.output_logprobs[split:]
    assert max(abs(a - b) for a, b in zip(truth, after, strict=True)) <= 1e-4


def test_http_routed_experts_and_model_info(moe, moe_dir):
    """SGLang's wire form: base64 of int32 rows in meta_info.routed_experts, decoded with
    np.frombuffer(...).reshape(-1, layers, top_k); /get_model_info gives that shape."""
    with TestClient(create_app(ServeConfig(model_dir=str(moe_dir)))) as client:
        info = client.get("/get_model_info").json()
        assert (info["moe_layers"], info["num_experts"], info["top_k"]) == (LAYERS, 8, TOP_K)
        prompt = prompt_ids(9, seed=21)
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0},
            "return_routed_experts": True,
        }
        out = client.post("/generate", json=body).json()
        rows = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), np.int32)
        rows = rows.reshape(-1, info["moe_layers"], info["top_k"])
        assert rows.shape[0] == len(prompt) + len(out["output_ids"]) - 1
        expected = engine_routing(moe, (prompt + out["output_ids"])[:-1])
        assert np.array_equal(rows, expected.numpy())
        plain = client.post("/generate", json={**body, "return_routed_experts": False}).json()
        assert "routed_experts" not in plain["meta_info"]


def test_dense_model_refuses_routed_experts(model_dir, model, tok):
    with TestClient(create_app(ServeConfig(model_dir=str(model_dir)))) as client:
        body = {"input_ids": [1, 2, 3], "return_routed_experts": True}
        response = client.post("/generate", json=body)
        assert response.status_code == 400
        assert f"model {model_dir.name} is not a mixture of experts" in response.json()["message"]
        assert "moe_layers" not in client.get("/get_model_info").json()
    dense = Engine(model, tok.decode, tok.eos_token_ids).start()
    try:
        with pytest.raises(RequestRejected, match="not a mixture of experts"):
            dense.submit(request([1, 2, 3], max_new_tokens=1))
    finally:
        dense.stop()


def _displacing_router(router, inputs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Router weights whose top-2 differs from ``rows`` at every position they cover, while
    the logits of the experts in ``rows`` stay as they were: at each position the best
    expert left out is lifted 1.0 above the second one chosen. ``W + U^T``, with ``U`` the
    least-norm solution of ``inputs @ U = lift`` (fewer positions than hidden dims: exact);
    positions past ``rows`` (the last, never fed to the engine) keep their logits."""
    x = inputs.double()
    logits = x @ router.weight.detach().double().t()
    lift = torch.zeros_like(logits)
    for t, (a, b) in enumerate(rows.tolist()):
        left_out = logits[t].clone()
        left_out[[a, b]] = float("-inf")
        c = int(left_out.argmax())
        lift[t, c] = logits[t, b] - logits[t, c] + 1.0
    u = torch.linalg.lstsq(x, lift).solution
    assert (x @ u - lift).abs().max().item() < 1e-8
    return (router.weight.detach().double() + u.t()).float()


def test_replay_routing_makes_transformers_route_as_the_engine(moe_dir, sampled):
    """R3: a trainer whose router would choose other experts scores the sampled tokens as
    the engine did only when it replays the engine's routing.

    The perturbed router keeps, at every position, the logits of the experts the engine
    chose (so their renormalised weights are the engine's) but lifts another expert into
    its own top-2. Without replay it routes elsewhere and its logprobs differ; with
    ``replay_routing`` it routes by the engine's rows (the last position, never fed to the
    engine, has -1: its own top-k) and its logprobs equal the engine's. A replay that did
    nothing would give the no-replay numbers."""
    prompt, seq = sampled.prompt_ids, sampled.prompt_ids + sampled.output_ids
    engine_lp = torch.tensor(sampled.output_logprobs)
    routing = torch.cat([sampled.routed_experts, torch.full((1, LAYERS, TOP_K), -1)]).long()
    hf = hf_model(moe_dir)
    _, own, inputs = hf_pass(hf, [seq])
    assert torch.equal(own[0, :-1], sampled.routed_experts.long())
    with torch.no_grad():
        for layer, router in enumerate(moe_routers(hf)):
            router.weight.copy_(
                _displacing_router(router, inputs[layer], sampled.routed_experts[:, layer])
            )

    logprobs, perturbed_rows, _ = hf_pass(hf, [seq])
    differs = (perturbed_rows[0, :-1] != sampled.routed_experts.long()).any(-1)
    # the first MoE layer's inputs do not depend on routing: it routes elsewhere everywhere
    assert differs[:, 0].all() and differs[:, 1].any()
    without = picked_logprobs(logprobs[0], seq, len(prompt))
    assert (without - engine_lp).abs().max().item() > 1e-2

    with replay_routing(hf, routing):
        logprobs, replayed_rows, _ = hf_pass(hf, [seq])
    assert torch.equal(replayed_rows[0, :-1], sampled.routed_experts.long())
    # -1: its own top-k, of inputs and router logits (not lifted there) as the original's
    assert torch.equal(replayed_rows[0, -1], own[0, -1])
    replayed = picked_logprobs(logprobs[0], seq, len(prompt))
    assert (replayed - engine_lp).abs().max().item() <= 1e-4

    # vLLM's and SGLang's rows: every decoder layer, the dense one's unread
    every = torch.full((routing.shape[0], 3, TOP_K), 5, dtype=torch.long)
    every[:, list(MOE_LAYERS)] = routing
    with replay_routing(hf, every):
        logprobs, _, _ = hf_pass(hf, [seq])
    assert (picked_logprobs(logprobs[0], seq, len(prompt)) - engine_lp).abs().max() <= 1e-4

    # batch-major [batch, seq, layers, top_k]; the model is itself again afterwards
    with replay_routing(hf, torch.stack([routing, routing])):
        batched, _, _ = hf_pass(hf, [seq, seq])
    for row in batched:
        assert (picked_logprobs(row, seq, len(prompt)) - engine_lp).abs().max().item() <= 1e-4
    assert torch.equal(hf_pass(hf, [seq])[1], perturbed_rows)


def test_replay_routing_refuses_what_does_not_fit(moe_dir):
    hf = hf_model(moe_dir)
    ids = torch.zeros(6, LAYERS, TOP_K, dtype=torch.long)
    small = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    dense = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**small))
    mixtral = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2)
    )
    for model, routing, match in (
        (hf, ids[:, :1], "routing has 1 MoE layers; Qwen3MoeForCausalLM has 2 of 3"),
        (hf, ids[:, :, :1], "routing picks top 1"),
        (hf, ids + 8, r"\[0, 8\)"),
        (hf, ids.float(), "must be integers"),
        (dense, ids, "Qwen3ForCausalLM has no sparse MoE blocks"),
        (mixtral, ids, "gate is a MixtralTopKRouter; routing replay knows Qwen3MoeTopKRouter"),
    ):
        with pytest.raises(RoutingReplayError, match=match), replay_routing(model, routing):
            pass
    with (
        pytest.raises(RoutingReplayError, match="covers 6 tokens; the forward has 5"),
        replay_routing(hf, ids),
        torch.no_grad(),
    ):
        hf(torch.tensor([[1, 2, 3, 4, 5]]))
    assert "forward" not in moe_routers(hf)[0].__dict__  # restored after the error
