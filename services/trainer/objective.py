"""The RL objective as plain functions: group-relative advantages, staleness weights and
the clipped token-level policy-gradient loss. No I/O; torch only where tensors flow.

Per token t of a sample with advantage A, behavior logprob b (captured when it was
sampled) and current logprob l (the trainer's forward, with grad):

    r = exp(l - b)                                  ratio pi_theta / pi_behavior
    s = min(r A, clip(r, 1 - eps, 1 + eps_high) A)  PPO clipping
    s = max(s, C A)  where A < 0                    dual clip: the ratio's weight is
                                                    truncated at C (a stale sample whose
                                                    ratio exploded cannot dominate)
    loss = -sum(w s mask) / denominator (+ kl_coef * k3(ref, l))

w is the staleness weight (1, or ``stale_weight`` past ``max_staleness``); the
denominator is the number of loss tokens (GRPO, RLOO) or samples x a constant (Dr. GRPO).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EPS = 1e-6


def advantages(rewards: list[float], objective: str) -> list[float]:
    """Group-relative advantages of one group's rewards.

    grpo: (r - mean) / (std + eps), std over the group (n - 1 denominator);
    rloo: r - mean of the other members; dr_grpo: r - mean (no std).
    A group of fewer than two, or of equal rewards, has advantage 0 everywhere."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = sum(rewards) / n
    if objective == "grpo":
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
        return [0.0 if std < EPS else (r - mean) / (std + EPS) for r in rewards]
    if objective == "rloo":
        total = sum(rewards)
        return [r - (total - r) / (n - 1) for r in rewards]
    if objective == "dr_grpo":
        return [r - mean for r in rewards]
    raise ValueError(f"unknown objective {objective!r}")


def version_number(version: str) -> int | None:
    try:
        return int(version)
    except ValueError:
        return None


def staleness(versions: list[str], current: int) -> int | None:
    """How many versions behind ``current`` the oldest version that sampled a trace is;
    None when a version is missing or not a step number (e.g. an engine never synced)."""
    numbers = [version_number(v) for v in versions]
    if not numbers or any(n is None for n in numbers):
        return None
    return current - min(numbers)


def stale_weight(age: int | None, max_staleness: int, policy: str, weight: float) -> float:
    """A sample's weight by its age: 1 within the bound; past it (or unknown) 0 to drop,
    ``weight`` to down-weight."""
    if age is not None and 0 <= age <= max_staleness:
        return 1.0
    return 0.0 if policy == "drop" else weight


@dataclass(frozen=True)
class LossParts:
    loss: torch.Tensor  # scalar, with grad
    pg_loss: float
    kl_ref: float  # k3 estimate of KL(pi_theta || pi_ref), 0 without a reference
    kl_behavior: float  # k3 estimate of KL(pi_behavior || pi_theta) over the loss tokens
    clip_fraction: float  # loss tokens whose gradient the clip (or the cap) removed
    capped_fraction: float  # loss tokens held by the dual-clip cap
    ratio_mean: float
    ratio_max: float
    tokens: int


def policy_loss(
    logp: torch.Tensor,
    behavior: torch.Tensor,
    adv: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    ratio_cap: float,
    denominator: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossParts:
    """The clipped surrogate over flat loss-token tensors (one entry per loss token)."""
    ratio = torch.exp(logp - behavior)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    capped = (adv < 0) & (ratio > ratio_cap)
    surrogate = torch.where(capped, ratio_cap * adv, surrogate)
    pg = -(weight * surrogate).sum() / denominator
    loss, kl_ref = pg, 0.0
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        k3 = torch.exp(d) - d - 1
        loss = pg + kl_coef * (weight * k3).sum() / denominator
        kl_ref = float(k3.mean().detach()) if k3.numel() else 0.0
    with torch.no_grad():
        n = logp.numel()
        removed = (clipped < unclipped) | capped
        lr = logp - behavior
        k3_b = torch.exp(lr) - lr - 1
        return LossParts(
            loss=loss,
            pg_loss=float(pg.detach()),
            kl_ref=kl_ref,
            kl_behavior=float(k3_b.mean()) if n else 0.0,
            clip_fraction=float(removed.float().mean()) if n else 0.0,
            capped_fraction=float(capped.float().mean()) if n else 0.0,
            ratio_mean=float(ratio.mean()) if n else 1.0,
            ratio_max=float(ratio.max()) if n else 1.0,
            tokens=n,
        )
