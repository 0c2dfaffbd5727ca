import pytest
import torch

from services.engine.weights import load_model
from services.trainer.batch import Sample
from services.trainer.policy import MismatchError, Policy, StepSettings, train_step
from tests.unit.engine.tiny import tiny_model_dir

SETTINGS = StepSettings(
    objective="grpo",
    eps_low=0.2,
    eps_high=0.2,
    ratio_cap=3.0,
    kl_coef=0.0,
    max_staleness=1,
    stale_policy="drop",
    stale_weight=0.1,
    dr_grpo_max_tokens=16,
    skip_zero_advantage=False,
    mismatch_threshold=1e-4,
    grad_clip=1.0,
)


def sampled(model, prompt: list[int], n: int, seed: int) -> tuple[list[int], list[float]]:
    """Tokens drawn the way the engine draws them: prefill, then one decode step each
    through the KV cache; the logprob of each drawn token at temperature 1."""
    g = torch.Generator().manual_seed(seed)
    cache = model.new_cache()
    logits = model.forward([prompt], [cache])[0]
    out, lps = [], []
    for _ in range(n):
        lp = torch.log_softmax(logits, dim=-1)
        tok = int(torch.multinomial(lp.exp(), 1, generator=g))
        out.append(tok)
        lps.append(float(lp[tok]))
        logits = model.forward([[tok]], [cache])[0]
    return out, lps


def make_samples(model, version="0", advs=(1.0, -1.0, 0.5)) -> list[Sample]:
    out = []
    for i, adv in enumerate(advs):
        prompt = [5 + i, 17, 300, 42, 99]
        toks, lps = sampled(model, prompt, 6, seed=i)
        out.append(
            Sample(
                task_id="t",
                session_id=f"s{i}",
                trace_index=0,
                tokens=prompt + toks,
                prompt_len=len(prompt),
                mask=[1] * 6,
                behavior=lps,
                versions=(version,),
                reward=adv,
                advantage=adv,
            )
        )
    return out


@pytest.fixture
def policy():
    return Policy(tiny_model_dir(), lr=1e-3)


def snapshot(policy):
    return {k: p.detach().clone() for k, p in policy.params.items()}


def changed(before, policy) -> list[str]:
    return [k for k, v in before.items() if not torch.equal(v, policy.params[k].detach())]


def test_the_training_forward_recomputes_the_cached_sampling_forward(policy):
    engine_model = load_model(tiny_model_dir())
    samples = make_samples(engine_model)
    rows = policy.logprobs(samples)
    for row, s in zip(rows, samples, strict=True):
        assert row.requires_grad
        assert (row.detach() - torch.tensor(s.behavior)).abs().max() < 1e-5


def test_gradients_reach_every_weight(policy):
    samples = make_samples(load_model(tiny_model_dir()))
    sum(r.sum() for r in policy.logprobs(samples)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.params.values())


def test_a_step_moves_the_weights_and_checks_every_on_policy_token(policy):
    samples = make_samples(load_model(tiny_model_dir()))
    before = snapshot(policy)
    stats = train_step(policy, samples, 0, SETTINGS)
    assert changed(before, policy)
    assert stats.mismatch_tokens == 18 and stats.mismatch_max < 1e-4
    assert stats.trained_samples == 3 and stats.loss_tokens == 18
    assert stats.staleness == {"0": 3} and stats.clip_fraction == 0.0


def test_a_mismatch_above_the_threshold_fails_the_step_before_it_steps(policy):
    samples = make_samples(load_model(tiny_model_dir()))
    bad = Sample(**{**vars(samples[0]), "behavior": [lp + 1e-3 for lp in samples[0].behavior]})
    before = snapshot(policy)
    with pytest.raises(MismatchError, match="mismatch"):
        train_step(policy, [bad, *samples[1:]], 0, SETTINGS)
    assert not changed(before, policy)


def test_a_batch_s_later_updates_skip_the_check_and_their_ratio_is_clipped(policy):
    """``updates_per_batch``: after the first update the weights are no longer the
    sampler's, so a checked second update would fail; unchecked, its ratio moves off 1 and
    the PPO clip applies to it."""
    samples = make_samples(load_model(tiny_model_dir()))
    train_step(policy, samples, 0, SETTINGS)
    with pytest.raises(MismatchError):
        train_step(policy, samples, 0, SETTINGS)
    before = snapshot(policy)
    later = train_step(policy, samples, 0, SETTINGS, check=False)
    assert changed(before, policy)
    assert later.mismatch_max is None and later.ratio_max != 1.0


def test_stale_samples_skip_the_check_and_are_dropped_past_the_bound(policy):
    model = load_model(tiny_model_dir())
    stale = make_samples(model, version="3")
    stale = [Sample(**{**vars(s), "behavior": [lp - 0.5 for lp in s.behavior]}) for s in stale]
    before = snapshot(policy)
    stats = train_step(policy, stale, 5, SETTINGS)  # age 2 > max_staleness 1
    assert stats.dropped_stale == 3 and stats.trained_samples == 0 and not changed(before, policy)
    stats = train_step(policy, stale, 4, SETTINGS)  # age 1: trained, ratio applied, not checked
    assert stats.mismatch_max is None and stats.trained_samples == 3
    assert stats.ratio_mean > 1.5 and stats.clip_fraction > 0  # r = e^0.5 ~ 1.65: clipped
    assert changed(before, policy)


def test_downweighted_stale_samples_are_trained_with_their_weight(policy):
    model = load_model(tiny_model_dir())
    settings = StepSettings(**{**vars(SETTINGS), "stale_policy": "downweight"})
    stats = train_step(policy, make_samples(model, version="0"), 5, settings)
    assert stats.downweighted == 3 and stats.trained_samples == 3


def test_dr_grpo_divides_by_samples_times_the_constant(policy):
    samples = make_samples(load_model(tiny_model_dir()), advs=(1.0, 1.0, 1.0))
    settings = StepSettings(**{**vars(SETTINGS), "objective": "dr_grpo"})
    stats = train_step(policy, samples, 0, settings)
    assert stats.pg_loss == pytest.approx(-18 / (3 * 16), rel=1e-4)  # r = 1 on-policy


def test_a_checkpoint_is_a_servable_hf_dir_and_restores_weights_and_optimizer(policy, tmp_path):
    samples = make_samples(load_model(tiny_model_dir()))
    train_step(policy, samples, 0, SETTINGS)
    policy.save(tmp_path / "ck")
    names = {p.name for p in (tmp_path / "ck").iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors", "optimizer.pt"} <= names
    served = load_model(tmp_path / "ck")  # what the engine loads on update_weights
    assert torch.equal(served.embed, policy.params["model.embed_tokens.weight"].detach())
    fresh = Policy(tiny_model_dir(), lr=1e-3)
    fresh.load(tmp_path / "ck")
    assert not changed(snapshot(policy), fresh)
    a, b = policy.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][k]["exp_avg"], b["state"][k]["exp_avg"]) for k in a["state"])
