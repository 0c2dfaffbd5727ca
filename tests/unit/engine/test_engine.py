"""The engine: logprob truth, determinism, stopping, batching, queue bound, weight control."""

import random
import time

import pytest

from services.engine.engine import Engine, EngineConfig, QueueFull, RequestRejected
from services.engine.sampling import SamplingParams
from services.engine.sequence import GenerationRequest
from services.engine.weights import load_model


@pytest.fixture
def make_engine(model, tok):
    engines = []

    def make(**config) -> Engine:
        engine = Engine(model, tok.decode, tok.eos_token_ids, EngineConfig(**config)).start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


def request(prompt, rid="r", **params) -> GenerationRequest:
    return GenerationRequest(rid=rid, prompt_ids=list(prompt), params=SamplingParams(**params))


def run(engine, *requests, timeout=60):
    futures = [engine.submit(r) for r in requests]
    return [f.result(timeout=timeout) for f in futures]


def max_diff(model, result) -> float:
    prompt = result.prompt_ids
    truth = model.teacher_forced_logprobs(prompt + result.output_ids, len(prompt))
    return max(
        (abs(a - b) for a, b in zip(truth, result.output_logprobs, strict=True)), default=0.0
    )


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def random_requests(n: int, seed: int) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(4096) for _ in range(rng.randint(1, 48))]
        params = dict(
            max_new_tokens=rng.randint(1, 24),
            temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
            top_p=rng.choice([1.0, 0.9, 0.5]),
            top_k=rng.choice([-1, 5, 50]),
            sampling_seed=rng.randrange(10**6),
        )
        out.append(request(prompt, rid=f"p{i}", **params))
    return out


def test_logprob_truth_200_prompts(make_engine, model, model_dir):
    """Reported logprobs equal an independent teacher-forced pass over prompt + output:
    our own uncached full-sequence forward, and transformers' Qwen2ForCausalLM."""
    engine = make_engine(max_batch=32, prefix_cache_tokens=0)
    results = run(engine, *random_requests(200, seed=11))
    assert sum(len(r.output_ids) for r in results) > 1000
    ours = max(max_diff(model, r) for r in results)
    print(f"\nlogprob truth, 200 prompts: max |reported - teacher-forced| = {ours:.3g}")
    assert ours <= 1e-4
    transformers = pytest.importorskip("transformers")
    import torch

    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for r in results:
            ids = r.prompt_ids + r.output_ids
            logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
            n = len(r.prompt_ids)
            truth = logprobs[n - 1 : len(ids) - 1].gather(1, torch.tensor(r.output_ids)[:, None])[
                :, 0
            ]
            worst = max(worst, (truth - torch.tensor(r.output_logprobs)).abs().max().item())
    print(f"logprob truth vs transformers Qwen2ForCausalLM: max diff = {worst:.3g}")
    assert worst <= 1e-4


def test_same_seed_same_tokens_alone_or_batched(make_engine):
    engine = make_engine()
    target = request(range(5, 25), max_new_tokens=40, sampling_seed=7, ignore_eos=True)
    alone = run(engine, target)[0]
    others = [
        request(range(i, i + 9), rid=f"o{i}", max_new_tokens=40, sampling_seed=i) for i in range(7)
    ]
    batched = run(engine, *others, target, *others)[len(others)]
    assert alone.output_ids == batched.output_ids
    other_seed = run(
        engine, request(range(5, 25), max_new_tokens=40, sampling_seed=8, ignore_eos=True)
    )[0]
    assert other_seed.output_ids != alone.output_ids


def test_stop_token_ids_and_stop_strings(make_engine, tok):
    engine = make_engine()
    prompt = tok.encode("The quick brown fox")
    base = run(engine, request(prompt, temperature=0, max_new_tokens=30, ignore_eos=True))[0]
    assert base.finish_reason == {"type": "length", "length": 30}
    stop_id = base.output_ids[5]
    first = base.output_ids.index(stop_id)
    by_id = run(
        engine, request(prompt, temperature=0, max_new_tokens=30, stop_token_ids=[stop_id])
    )[0]
    assert by_id.output_ids == base.output_ids[: first + 1]
    assert by_id.finish_reason == {"type": "stop", "matched": stop_id}
    held = run(
        engine,
        request(
            prompt,
            temperature=0,
            max_new_tokens=30,
            stop_token_ids=[base.output_ids[0]],
            min_new_tokens=3,
        ),
    )[0]
    assert base.output_ids[0] not in held.output_ids[:3] and len(held.output_ids) >= 3
    assert max_diff(engine.model, held) <= 1e-4
    stop_text = tok.decode(base.output_ids[8:10]).strip() or tok.decode(base.output_ids[8:10])
    by_text = run(engine, request(prompt, temperature=0, max_new_tokens=30, stop=[stop_text]))[0]
    assert by_text.finish_reason == {"type": "stop", "matched": stop_text}
    assert stop_text not in by_text.text
    assert tok.decode(base.output_ids).startswith(by_text.text)


def test_eos_ends_generation_unless_ignored(make_engine, tok):
    engine = make_engine()
    im_end = tok.encode("<|im_end|>")[0]
    # A one-token forced reply of <|im_end|> is the end of a turn: finish "stop".
    done = run(
        engine,
        GenerationRequest(rid="e", prompt_ids=[5, 6], params=SamplingParams(), forced_ids=[im_end]),
    )[0]
    assert done.output_ids == [im_end] and done.finish_reason == {"type": "stop", "matched": im_end}


def test_zero_new_tokens(make_engine):
    result = run(make_engine(), request([1, 2, 3], max_new_tokens=0))[0]
    assert result.output_ids == [] and result.finish_reason == {"type": "length", "length": 0}


def test_bad_requests_are_rejected(make_engine):
    engine = make_engine(context_limit=64)
    with pytest.raises(RequestRejected, match="context limit"):
        engine.submit(request(range(64)))
    with pytest.raises(RequestRejected, match="empty"):
        engine.submit(request([]))
    with pytest.raises(RequestRejected, match="vocabulary"):
        engine.submit(request([1, 99999]))
    capped = run(engine, request(range(60), max_new_tokens=50, ignore_eos=True))[0]
    assert capped.finish_reason["type"] == "length" and len(capped.output_ids) == 4


def test_bounded_queue(make_engine):
    engine = make_engine(max_batch=1, max_queue=2)
    engine.pause("in_place").result()
    waiting = [engine.submit(request([1, 2], rid=str(i), max_new_tokens=2)) for i in range(2)]
    with pytest.raises(QueueFull, match="queue is full"):
        engine.submit(request([1, 2], max_new_tokens=2))
    engine.resume().result()
    assert all(f.result(timeout=20).finish_reason["type"] == "length" for f in waiting)


def test_batching_runs_sequences_together(make_engine):
    engine = make_engine(max_batch=8)
    run(
        engine,
        *[request([i + 1, 2, 3], rid=str(i), max_new_tokens=20, ignore_eos=True) for i in range(8)],
    )
    stats = engine.stats()
    # 8 x 20 tokens in about 20 steps (plus a few when arrivals straddle a step).
    assert stats["generated_tokens"] == 160 and stats["steps"] <= 30


def test_prefix_cache_reuse_keeps_logprobs_true(make_engine, model):
    engine = make_engine()
    first = run(engine, request(range(10, 70), max_new_tokens=12, sampling_seed=1))[0]
    follow = first.prompt_ids + first.output_ids + [7, 8, 9]
    second = run(engine, request(follow, max_new_tokens=12, sampling_seed=2))[0]
    assert second.cached_tokens >= len(first.prompt_ids) + len(first.output_ids) - 1
    assert max_diff(model, second) <= 1e-4
    cold = make_engine(prefix_cache_tokens=0)
    assert (
        run(cold, request(follow, max_new_tokens=12, sampling_seed=2))[0].output_ids
        == second.output_ids
    )


def test_chunked_prefill_keeps_logprobs_true(make_engine, model):
    engine = make_engine(max_prefill_tokens=16)
    result = run(engine, request(range(100, 230), max_new_tokens=10, sampling_seed=3))[0]
    assert max_diff(model, result) <= 1e-4


def test_weight_update_drains_in_flight_on_old_weights(make_engine, model, checkpoint_v2):
    new_model = load_model(checkpoint_v2)
    engine = make_engine()
    prompt = list(range(30, 50))
    before = run(engine, request(prompt, temperature=0, max_new_tokens=16, ignore_eos=True))[0]
    in_flight = engine.submit(
        request(prompt, rid="long", max_new_tokens=300, ignore_eos=True, sampling_seed=4)
    )
    wait_for(lambda: engine.stats()["generated_tokens"] > 20)
    swap = engine.swap_weights(new_model)
    old = in_flight.result(timeout=60)
    assert swap.result(timeout=60) == ("2", 0)
    assert len(old.output_ids) == 300 and old.weight_version == "1" and old.weight_versions == ["1"]
    assert max_diff(model, old) <= 1e-4
    after = run(engine, request(prompt, temperature=0, max_new_tokens=16, ignore_eos=True))[0]
    assert after.weight_version == "2"
    assert max_diff(new_model, after) <= 1e-4
    fresh = Engine(new_model, engine.decode, engine.eos_ids).start()
    try:
        assert (
            run(fresh, request(prompt, temperature=0, max_new_tokens=16, ignore_eos=True))[
                0
            ].output_ids
            == after.output_ids
        )
    finally:
        fresh.stop()
    assert after.output_ids != before.output_ids


def test_pause_abort_ends_in_flight_and_holds_new_requests(make_engine, model):
    engine = make_engine()
    in_flight = engine.submit(
        request(range(3, 9), rid="a", max_new_tokens=400, ignore_eos=True, sampling_seed=1)
    )
    wait_for(lambda: engine.stats()["generated_tokens"] > 5)
    engine.pause("abort").result(timeout=10)
    aborted = in_flight.result(timeout=10)
    assert aborted.finish_reason["type"] == "abort" and 0 < len(aborted.output_ids) < 400
    assert aborted.weight_version == "1" and max_diff(model, aborted) <= 1e-4
    held = engine.submit(request([1, 2, 3], rid="b", max_new_tokens=3))
    time.sleep(0.2)
    assert not held.done()
    engine.resume().result(timeout=10)
    assert held.result(timeout=20).finish_reason["type"] == "length"


def test_in_place_pause_across_a_swap_reports_both_versions(make_engine, model, checkpoint_v2):
    new_model = load_model(checkpoint_v2)
    engine = make_engine()
    in_flight = engine.submit(
        request(range(3, 20), rid="x", max_new_tokens=300, ignore_eos=True, sampling_seed=9)
    )
    wait_for(lambda: engine.stats()["generated_tokens"] > 10)
    engine.pause("in_place").result(timeout=10)
    assert engine.swap_weights(new_model).result(timeout=10) == ("2", 1)
    engine.resume().result(timeout=10)
    result = in_flight.result(timeout=60)
    assert result.weight_versions == ["1", "2"] and result.weight_version == "2"
    split = result.weight_version_starts[1]
    assert 10 <= split < 300
    prompt, out = result.prompt_ids, result.output_ids
    old_truth = model.teacher_forced_logprobs(prompt + out[:split], len(prompt))
    new_truth = new_model.teacher_forced_logprobs(prompt + out, len(prompt) + split)
    assert (
        max(abs(a - b) for a, b in zip(old_truth + new_truth, result.output_logprobs, strict=True))
        <= 1e-4
    )


def test_retract_recomputes_and_finishes_normally(make_engine, model):
    engine = make_engine()
    in_flight = engine.submit(
        request(range(3, 20), max_new_tokens=200, ignore_eos=True, sampling_seed=2)
    )
    wait_for(lambda: engine.stats()["generated_tokens"] > 10)
    engine.pause("retract").result(timeout=10)
    assert engine.stats()["waiting"] == 1
    engine.resume().result(timeout=10)
    result = in_flight.result(timeout=60)
    assert len(result.output_ids) == 200 and max_diff(model, result) <= 1e-4


def test_flush_cache_refused_while_busy(make_engine):
    engine = make_engine()
    run(engine, request([1, 2, 3], max_new_tokens=2))
    assert engine.stats()["prefix_cache_entries"] == 1
    in_flight = engine.submit(request([4, 5], max_new_tokens=300, ignore_eos=True))
    assert engine.flush_cache().result(timeout=10) is False
    engine.abort().result(timeout=10)
    assert in_flight.result(timeout=10).finish_reason["type"] == "abort"
    assert engine.flush_cache().result(timeout=10) is True
    assert engine.stats()["prefix_cache_entries"] == 0


def test_abort_one_request_by_id(make_engine):
    engine = make_engine()
    keep = engine.submit(request([1, 2], rid="keep", max_new_tokens=30, ignore_eos=True))
    drop = engine.submit(request([1, 2], rid="drop", max_new_tokens=3000, ignore_eos=True))
    assert engine.abort("drop").result(timeout=10) == 1
    assert drop.result(timeout=10).finish_reason["type"] == "abort"
    assert keep.result(timeout=20).finish_reason["type"] == "length"


def test_stop_resolves_everything_in_flight(model, tok, checkpoint_v2):
    engine = Engine(model, tok.decode, tok.eos_token_ids).start()
    running = engine.submit(request([1, 2], rid="run", max_new_tokens=5000, ignore_eos=True))
    wait_for(lambda: engine.stats()["generated_tokens"] > 3)
    swap = engine.swap_weights(load_model(checkpoint_v2))  # waits for the drain, never comes
    engine.stop()
    assert running.result(timeout=10).finish_reason == {
        "type": "abort",
        "message": "server shutting down",
    }
    with pytest.raises(Exception, match="stopped before the weight swap"):
        swap.result(timeout=10)
