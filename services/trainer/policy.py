"""The policy being trained: Hugging Face weights as parameters, the engine's own forward
(``CausalLM.shared_prefix_logprobs``: the math the engine samples with, each shared
prompt once), AdamW.

``train_step`` is one optimizer step on a batch of samples; it checks, before stepping,
that on-policy tokens (sampled by exactly the weights held now) recompute to their
captured logprobs within the threshold, and raises ``MismatchError`` otherwise.

A vision model's samples carry their images by digest and token span; the policy holds
their pixels (``add_images``: the bytes the loop read from the object store) and runs
the image encoder with the live weights, so its ``visual.*`` weights train too.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.engine.model import CausalLM
from services.engine.modelconfig import load_config
from services.engine.vision import SequenceImages, place_images, preprocess
from services.engine.weights import load_tensors, save_tensors
from services.trainer.batch import Sample, staleness_histogram
from services.trainer.objective import policy_loss, stale_weight, staleness

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class MismatchError(RuntimeError):
    """The trainer's recomputation of on-policy tokens disagrees with the captured logprobs:
    the trainer does not train the policy that sampled (wrong weights, wrong forward)."""


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        # exact float32 matmuls: the engine's logprobs are float32 too
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return torch.device(name)


@dataclass(frozen=True)
class StepSettings:
    objective: str
    eps_low: float
    eps_high: float
    ratio_cap: float
    kl_coef: float
    max_staleness: int
    stale_policy: str
    stale_weight: float
    dr_grpo_max_tokens: int
    skip_zero_advantage: bool
    mismatch_threshold: float
    grad_clip: float | None


@dataclass
class StepStats:
    loss: float = 0.0
    pg_loss: float = 0.0
    kl_ref: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    capped_fraction: float = 0.0
    ratio_mean: float = 1.0
    ratio_max: float = 1.0
    grad_norm: float = 0.0
    samples: int = 0
    trained_samples: int = 0
    loss_tokens: int = 0
    tokens: int = 0  # tokens through the forward (prompt + response)
    mismatch_max: float | None = None  # None: no on-policy token in this step
    mismatch_tokens: int = 0
    mixed_version_samples: int = 0
    staleness: dict[str, int] = field(default_factory=dict)
    dropped_stale: int = 0
    downweighted: int = 0
    train_seconds: float = 0.0


class Policy:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        lr: float,
        weight_decay: float = 0.0,
        device: str = "cpu",
        reference: bool = False,
    ) -> None:
        self.base_dir = Path(model_dir)
        self.config = load_config(model_dir)
        self.device = pick_device(device)
        tensors = load_tensors(model_dir)
        self.names = sorted(tensors)
        self.params = {
            k: torch.nn.Parameter(tensors[k].to(self.device).contiguous()) for k in self.names
        }
        self.optimizer = torch.optim.AdamW(
            [self.params[k] for k in self.names], lr=lr, weight_decay=weight_decay
        )
        self.reference = (
            CausalLM(self.config, {k: v.to(self.device) for k, v in tensors.items()})
            if reference
            else None
        )
        self.pixels: dict[str, torch.Tensor] = {}  # digest -> preprocessed image

    def add_images(self, images: dict[str, bytes]) -> None:
        """The pixels of images samples will name (ImageInputError for bytes that do not
        decode: the proxy stored what it was sent)."""
        vision = self.config.vision
        if vision is None:
            raise ValueError(f"{self.base_dir} reads no images: its samples cannot hold any")
        for digest, data in images.items():
            self.pixels[digest] = preprocess(data, vision.image_size)

    def keep_images(self, digests: set[str]) -> None:
        """Forget the pixels of every image not in ``digests``."""
        self.pixels = {d: p for d, p in self.pixels.items() if d in digests}

    def sample_images(
        self, samples: list[Sample], model: CausalLM
    ) -> list[SequenceImages | None] | None:
        """Each sample's image embeddings from ``model``'s encoder (each image once)."""
        if not any(s.images for s in samples):
            return None
        digests = sorted({im.digest for s in samples for im in s.images})
        missing = [d for d in digests if d not in self.pixels]
        if missing:
            raise KeyError(f"no pixels for images {missing[:3]} (add_images first)")
        embeds = model.encode_images(torch.stack([self.pixels[d] for d in digests]))
        row = {d: i for i, d in enumerate(digests)}
        return [
            place_images(
                [(im.start, im.length) for im in s.images],
                embeds[[row[im.digest] for im in s.images]],
                [im.digest for im in s.images],
            )
            if s.images
            else None
            for s in samples
        ]

    def model(self) -> CausalLM:
        """A CausalLM over the live parameters (its fused weights are built from them with
        grad, so a backward through it reaches the parameters)."""
        return CausalLM(self.config, self.params)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: p.detach().cpu() for k, p in self.params.items()}

    def logprobs(self, samples: list[Sample], model: CausalLM | None = None) -> list[torch.Tensor]:
        model = model or self.model()
        # a group's samples share their prompt: it goes through the forward once
        return model.shared_prefix_logprobs(
            [s.tokens for s in samples],
            [s.prompt_len for s in samples],
            self.sample_images(samples, model),
        )

    # -- checkpoints ------------------------------------------------------------------
    def save(self, out: Path) -> None:
        """A Hugging Face directory: the weights, every other file of the base directory
        (config, tokenizer, chat template), and the optimizer state."""
        out.mkdir(parents=True, exist_ok=True)
        for src in self.base_dir.iterdir():
            if src.is_file() and src.name not in WEIGHT_FILES:
                shutil.copy2(src, out / src.name)
        save_tensors(self.tensors(), out)
        torch.save(self.optimizer.state_dict(), out / "optimizer.pt")

    def load(self, ckpt: Path) -> None:
        tensors = load_tensors(ckpt)
        with torch.no_grad():
            for k in self.names:
                self.params[k].copy_(tensors[k].to(self.device))
        opt = ckpt / "optimizer.pt"
        if opt.exists():
            self.optimizer.load_state_dict(torch.load(opt, map_location=self.device))


def _flat(values: list[list[float]], masks: list[list[int]], device) -> torch.Tensor:
    flat = [
        v for row, m in zip(values, masks, strict=True) for v, k in zip(row, m, strict=True) if k
    ]
    return torch.tensor(flat, dtype=torch.float32, device=device)


def _mask_select(rows: list[torch.Tensor], masks: list[list[int]], device) -> torch.Tensor:
    keep = torch.tensor([k for m in masks for k in m], dtype=torch.bool, device=device)
    return torch.cat(rows)[keep]


def sample_weights(
    samples: list[Sample], version: int, s: StepSettings, stats: StepStats
) -> list[float]:
    ages = [staleness(list(x.versions), version) for x in samples]
    stats.staleness = staleness_histogram(ages)
    weights = [stale_weight(a, s.max_staleness, s.stale_policy, s.stale_weight) for a in ages]
    stats.dropped_stale = sum(1 for w in weights if w == 0.0)
    stats.downweighted = sum(1 for w in weights if 0.0 < w < 1.0)
    return weights


def on_policy(sample: Sample, version: int) -> bool:
    return sample.versions == (str(version),)


def train_step(
    policy: Policy, samples: list[Sample], version: int, s: StepSettings, *, check: bool = True
) -> StepStats:
    """One optimizer step on ``samples`` at weights ``version``. Raises MismatchError before
    stepping when an on-policy token recomputes more than the threshold off (``check``: off
    for a batch's later updates, whose weights have already moved from the sampler's)."""
    t0 = time.perf_counter()
    stats = StepStats(samples=len(samples))
    weights = sample_weights(samples, version, s, stats)
    denominator_tokens = sum(x.loss_tokens for x, w in zip(samples, weights, strict=True) if w > 0)
    chosen = [
        (x, w)
        for x, w in zip(samples, weights, strict=True)
        if w > 0 and not (s.skip_zero_advantage and x.advantage == 0.0)
    ]
    stats.mixed_version_samples = sum(1 for x in samples if len(set(x.versions)) > 1)
    if not chosen:
        stats.train_seconds = time.perf_counter() - t0
        return stats
    batch = [x for x, _ in chosen]
    masks = [x.mask for x in batch]
    dev = policy.device
    rows = policy.logprobs(batch)
    logp = _mask_select(rows, masks, dev)
    behavior = _flat([x.behavior for x in batch], masks, dev)
    if check:
        _check_mismatch(rows, batch, version, s.mismatch_threshold, stats)
    adv = _flat([[x.advantage] * len(x.mask) for x in batch], masks, dev)
    w = _flat([[wt] * len(x.mask) for x, wt in chosen], masks, dev)
    ref = None
    if policy.reference is not None and s.kl_coef > 0:
        with torch.no_grad():
            ref = _mask_select(policy.logprobs(batch, policy.reference), masks, dev)
    if s.objective == "dr_grpo":
        denominator = float(sum(1 for wt in weights if wt > 0))
        denominator *= s.dr_grpo_max_tokens
    else:
        denominator = float(max(1, denominator_tokens))
    parts = policy_loss(
        logp,
        behavior,
        adv,
        w,
        eps_low=s.eps_low,
        eps_high=s.eps_high,
        ratio_cap=s.ratio_cap,
        denominator=denominator,
        ref_logp=ref,
        kl_coef=s.kl_coef,
    )
    policy.optimizer.zero_grad(set_to_none=True)
    parts.loss.backward()
    params = list(policy.params.values())
    if s.grad_clip:
        norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
    else:
        norm = torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
    policy.optimizer.step()
    stats.loss, stats.pg_loss, stats.kl_ref = (
        float(parts.loss.detach()),
        parts.pg_loss,
        parts.kl_ref,
    )
    stats.kl, stats.clip_fraction = parts.kl_behavior, parts.clip_fraction
    stats.capped_fraction = parts.capped_fraction
    stats.ratio_mean, stats.ratio_max = parts.ratio_mean, parts.ratio_max
    stats.grad_norm = float(norm)
    stats.trained_samples, stats.loss_tokens = len(batch), parts.tokens
    stats.tokens = sum(len(x.tokens) for x in batch)
    stats.train_seconds = time.perf_counter() - t0
    return stats


def _check_mismatch(
    rows: list[torch.Tensor], batch: list[Sample], version: int, threshold: float, stats: StepStats
) -> None:
    worst, n = 0.0, 0
    with torch.no_grad():
        for row, x in zip(rows, batch, strict=True):
            if not on_policy(x, version):
                continue
            keep = torch.tensor(x.mask, dtype=torch.bool, device=row.device)
            got = row[keep]
            want = torch.tensor(x.behavior, dtype=torch.float32, device=row.device)[keep]
            if got.numel():
                worst = max(worst, float((got - want).abs().max()))
                n += got.numel()
    stats.mismatch_tokens = n
    stats.mismatch_max = worst if n else None
    if n and worst > threshold:
        raise MismatchError(
            f"on-policy logprob mismatch {worst:.3g} > {threshold:g} over {n} tokens at "
            f"version {version}: the trainer is not recomputing the sampling policy"
        )
