import random

import pytest
import torch

from services.engine.sampling import (
    SamplingParams,
    banned_ids,
    choose_tokens,
    filtered_distribution,
    stop_string_hit,
    stop_token_hit,
    tail_window,
    trim_at_stop,
    validate,
)

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def draws(params: SamplingParams, n: int = 400, logits=LOGITS) -> set[int]:
    rng = random.Random(0)
    seen = set()
    for _ in range(n):
        tokens, _ = choose_tokens(logits, [params], [rng.random()], [None])
        seen.add(tokens[0])
    return seen


def test_greedy_and_top_k_1_are_argmax():
    assert draws(SamplingParams(temperature=0)) == {0}
    assert draws(SamplingParams(top_k=1)) == {0}


def test_top_k_limits_the_support():
    assert draws(SamplingParams(top_k=3)) == {0, 1, 2}


def test_top_p_limits_the_support():
    probs = torch.softmax(LOGITS[0], -1)  # 0.56, 0.21, 0.13, 0.08, ...
    assert probs[0] < 0.6 < probs[0] + probs[1]
    assert draws(SamplingParams(top_p=0.6)) == {0, 1}
    assert draws(SamplingParams(top_p=0.5)) == {0}


def test_min_p_limits_the_support():
    # exp(-1.5) = 0.22 relative: tokens 0..2 pass 0.2 * p_max, token 3 (0.135) does not.
    assert draws(SamplingParams(min_p=0.2)) == {0, 1, 2}


def test_full_distribution_is_reachable_and_frequencies_match():
    rng = random.Random(5)
    counts = torch.zeros(6)
    n = 4000
    for _ in range(n):
        tokens, _ = choose_tokens(LOGITS, [SamplingParams()], [rng.random()], [None])
        counts[tokens[0]] += 1
    expected = torch.softmax(LOGITS[0], -1)
    assert (counts / n - expected).abs().max().item() < 0.03


def test_temperature_sharpens():
    low = draws(SamplingParams(temperature=0.05))
    assert low == {0}


def test_reported_logprob_is_the_raw_distribution():
    raw = torch.log_softmax(LOGITS[0], -1)
    params = [
        SamplingParams(temperature=0.3, top_k=2),
        SamplingParams(temperature=0),
        SamplingParams(),
    ]
    tokens, logprobs = choose_tokens(LOGITS.repeat(3, 1), params, [0.9, 0.5, 0.99], [None, None, 4])
    assert tokens[2] == 4  # forced
    for token, lp in zip(tokens, logprobs, strict=True):
        assert lp == pytest.approx(raw[token].item(), abs=1e-6)


def test_uniform_decides_the_draw_deterministically():
    params = [SamplingParams(), SamplingParams(top_p=0.9)]
    a = choose_tokens(LOGITS.repeat(2, 1), params, [0.42, 0.42], [None, None])
    b = choose_tokens(LOGITS.repeat(2, 1), params, [0.42, 0.42], [None, None])
    assert a == b


def test_filtered_distribution_keeps_at_least_one_token():
    probs, order = filtered_distribution(LOGITS, [SamplingParams(top_p=1e-9, top_k=1, min_p=1.0)])
    assert (probs > 0).sum().item() == 1 and order[0, 0].item() == 0


def test_validation_messages():
    assert validate(SamplingParams()) is None
    assert "top_p" in validate(SamplingParams(top_p=0))
    assert "temperature" in validate(SamplingParams(temperature=-1))
    assert "max_new_tokens" in validate(SamplingParams(max_new_tokens=-1))
    assert "top_k" in validate(SamplingParams(top_k=-5))


def test_banned_ids_change_the_choice_not_the_logprob():
    raw = torch.log_softmax(LOGITS[0], -1)
    tokens, logprobs = choose_tokens(LOGITS, [SamplingParams(temperature=0)], [0.0], [None], [[0]])
    assert tokens == [1] and logprobs[0] == pytest.approx(raw[1].item(), abs=1e-6)
    p = SamplingParams(min_new_tokens=2, stop_token_ids=[7])
    assert banned_ids(p, 1, [2]) == [7, 2] and banned_ids(p, 2, [2]) == []
    assert banned_ids(SamplingParams(min_new_tokens=3, ignore_eos=True), 0, [2]) == []


def test_stop_tokens_respect_min_new_tokens_and_ignore_eos():
    p = SamplingParams(stop_token_ids=[7], min_new_tokens=2)
    assert not stop_token_hit(7, 1, p, [2])
    assert stop_token_hit(7, 2, p, [2])
    assert stop_token_hit(2, 3, p, [2])
    assert not stop_token_hit(2, 3, SamplingParams(ignore_eos=True), [2])


def test_stop_strings_window_and_trim():
    p = SamplingParams(stop=["STOP", "\n\n"])
    assert tail_window(p) == 18
    assert stop_string_hit("abc STOP def", p, 3) == "STOP"
    assert stop_string_hit("abc", p, 3) is None
    assert trim_at_stop("hello STOP world", "STOP", p) == "hello "
    assert (
        trim_at_stop("hello STOP", "STOP", SamplingParams(stop=["STOP"], no_stop_trim=True))
        == "hello STOP"
    )
