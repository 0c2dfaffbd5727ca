import math

import pytest
import torch

from services.trainer.objective import advantages, policy_loss, stale_weight, staleness


def test_grpo_is_std_normalized():
    adv = advantages([1.0, 0.0, 0.0, 1.0], "grpo")
    std = math.sqrt(4 * 0.25 / 3)
    assert adv == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)


def test_rloo_is_leave_one_out():
    assert advantages([1.0, 0.0, 0.0, 0.0], "rloo") == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


def test_dr_grpo_is_mean_centred_only():
    assert advantages([1.0, 0.0, 0.5], "dr_grpo") == pytest.approx([0.5, -0.5, 0.0])


@pytest.mark.parametrize("objective", ["grpo", "rloo", "dr_grpo"])
def test_degenerate_and_equal_groups_have_zero_advantage(objective):
    assert advantages([1.0], objective) == [0.0]
    assert advantages([0.7, 0.7, 0.7], objective) == pytest.approx([0.0, 0.0, 0.0])


def test_unknown_objective_is_an_error():
    with pytest.raises(ValueError, match="unknown objective"):
        advantages([0.0, 1.0], "ppo")


def test_staleness_is_counted_from_the_oldest_version():
    assert staleness(["3"], 5) == 2
    assert staleness(["3", "4"], 5) == 2  # a trace spanning a swap is as old as its oldest
    assert staleness([], 5) is None
    assert staleness(["v1"], 5) is None  # not a step number: unknown


def test_stale_weight_by_policy():
    assert stale_weight(2, 2, "drop", 0.1) == 1.0
    assert stale_weight(3, 2, "drop", 0.1) == 0.0
    assert stale_weight(3, 2, "downweight", 0.1) == 0.1
    assert stale_weight(None, 2, "downweight", 0.1) == 0.1  # unknown: past the bound


def _loss(logp, behavior, adv, weight=None, **kw):
    logp = torch.tensor(logp, requires_grad=True)
    kw = {"eps_low": 0.2, "eps_high": 0.2, "ratio_cap": 3.0, "denominator": 1.0, **kw}
    w = torch.ones_like(logp) if weight is None else torch.tensor(weight)
    parts = policy_loss(logp, torch.tensor(behavior), torch.tensor(adv), w, **kw)
    parts.loss.backward()
    return parts, logp.grad


def test_on_policy_tokens_are_not_clipped_and_get_the_plain_gradient():
    parts, grad = _loss([-1.0, -2.0], [-1.0, -2.0], [1.0, -0.5])
    assert parts.clip_fraction == 0.0 and parts.ratio_mean == pytest.approx(1.0)
    assert grad.tolist() == pytest.approx([-1.0, 0.5])  # -A * r * dlogp, r = 1


def test_clipping_removes_the_gradient_past_the_trust_region():
    # r = e^0.5 = 1.65 > 1.2 with A > 0: clipped; r = e^-0.5 = 0.61 < 0.8 with A < 0: clipped;
    # r = 1.65 with A < 0: kept (the pessimistic side); r = 0.61 with A > 0: kept
    logp, behavior = [-0.5, -1.5, -0.5, -1.5], [-1.0, -1.0, -1.0, -1.0]
    parts, grad = _loss(logp, behavior, [1.0, -1.0, -1.0, 1.0])
    r_hi, r_lo = math.exp(0.5), math.exp(-0.5)
    assert parts.clip_fraction == 0.5
    assert grad.tolist() == pytest.approx([0.0, 0.0, r_hi, -r_lo], rel=1e-5)


def test_the_dual_clip_caps_a_stale_ratio_with_negative_advantage():
    # r = e^2 = 7.4 > cap 3 with A < 0: the objective is held at cap * A, no gradient
    parts, grad = _loss([1.0], [-1.0], [-1.0])
    assert parts.capped_fraction == 1.0 and parts.clip_fraction == 1.0
    assert float(parts.loss.detach()) == pytest.approx(3.0)
    assert grad.tolist() == [0.0]


def test_asymmetric_clip_and_weights_and_denominator():
    # r = e^0.25 = 1.28: inside eps_high 0.3, so not clipped; the weight and the
    # denominator scale the gradient
    parts, grad = _loss([-0.75], [-1.0], [1.0], weight=[0.5], eps_high=0.3, denominator=4.0)
    assert parts.clip_fraction == 0.0
    assert grad.tolist() == pytest.approx([-0.5 * math.exp(0.25) / 4.0], rel=1e-5)


def test_kl_to_the_reference_adds_its_k3_gradient():
    logp = torch.tensor([-1.0], requires_grad=True)
    ref = torch.tensor([-1.5])
    parts = policy_loss(
        logp,
        logp.detach().clone(),
        torch.tensor([0.0]),
        torch.tensor([1.0]),
        eps_low=0.2,
        eps_high=0.2,
        ratio_cap=3.0,
        denominator=1.0,
        ref_logp=ref,
        kl_coef=0.1,
    )
    parts.loss.backward()
    d = -0.5  # ref - logp
    assert parts.kl_ref == pytest.approx(math.exp(d) - d - 1, rel=1e-5)
    assert logp.grad.tolist() == pytest.approx([0.1 * (1 - math.exp(d))], rel=1e-5)
