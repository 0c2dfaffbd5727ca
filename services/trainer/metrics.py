"""What the trainer reports: Prometheus gauges, the JSONL log, the PNG of the curves."""

from __future__ import annotations

from pathlib import Path

import orjson
from prometheus_client import Counter, Gauge, Histogram

STEP = Gauge("polar_trainer_step", "Optimizer steps taken (the weight version)")
REWARD = Gauge("polar_trainer_reward_mean", "Mean reward of the last step's groups")
HELDOUT = Gauge("polar_trainer_heldout_accuracy", "Last held-out accuracy (greedy)")
LOSS = Gauge("polar_trainer_loss", "Last step's loss")
CLIP = Gauge("polar_trainer_clip_fraction", "Last step's clipped token fraction")
KL = Gauge("polar_trainer_kl", "Last step's KL(behavior || current) estimate")
MISMATCH = Gauge("polar_trainer_logprob_mismatch", "Last step's max |d logprob| on-policy")
TOKENS_PER_S = Gauge("polar_trainer_tokens_per_second", "Last step's trained tokens per second")
GROUPS = Counter("polar_trainer_groups_total", "Groups trained on")
SAMPLES = Counter("polar_trainer_samples_total", "Samples by fate", ["fate"])
AGES = Counter(
    "polar_trainer_sample_staleness_total",
    "Samples by staleness (trainer version minus the version that sampled them)",
    ["age"],
)
PHASE = Histogram(
    "polar_trainer_phase_seconds",
    "Time per step by phase",
    ["phase"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
)


def observe_step(rec: dict) -> None:
    STEP.set(rec["step"])
    REWARD.set(rec["reward_mean"])
    LOSS.set(rec["loss"])
    CLIP.set(rec["clip_fraction"])
    KL.set(rec["kl"])
    if rec["mismatch_max"] is not None:
        MISMATCH.set(rec["mismatch_max"])
    TOKENS_PER_S.set(rec["train_tokens_per_s"])
    GROUPS.inc(len(rec["groups"]))
    SAMPLES.labels("trained").inc(rec["trained_samples"])
    SAMPLES.labels("dropped_stale").inc(rec["dropped_stale"])
    SAMPLES.labels("downweighted").inc(rec["downweighted"])
    for age, n in rec["staleness"].items():
        AGES.labels(age).inc(n)
    for phase in ("rollout_wait", "train", "checkpoint", "sync"):
        PHASE.labels(phase).observe(rec[f"{phase}_s"])


def observe_eval(rec: dict) -> None:
    HELDOUT.set(rec["accuracy"])


def append_log(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        for r in records:
            f.write(orjson.dumps(r) + b"\n")


def plot(records: list[dict], out: Path) -> Path:
    """Reward, held-out accuracy, loss / clip fraction, mismatch and the time split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # by step, the last record wins (an evaluation redone after a restart)
    steps = list({r["step"]: r for r in records if r.get("type") == "step"}.values())
    evals = list({r["step"]: r for r in records if r.get("type") == "eval"}.values())
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    ax.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], label="train reward")
    ax.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", label="held-out")
    ax.set_xlabel("step"), ax.set_ylim(-0.05, 1.05), ax.legend(), ax.set_title("reward")
    ax = axes[0][1]
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="loss")
    ax.plot([r["step"] for r in steps], [r["clip_fraction"] for r in steps], label="clip frac")
    ax.plot([r["step"] for r in steps], [r["kl"] for r in steps], label="KL")
    ax.set_xlabel("step"), ax.legend(), ax.set_title("objective")
    ax = axes[1][0]
    mm = [(r["step"], r["mismatch_max"]) for r in steps if r["mismatch_max"] is not None]
    if mm:
        ax.semilogy([s for s, _ in mm], [max(v, 1e-9) for _, v in mm], "o-", label="max |Δ|")
        ax.axhline(steps[-1]["mismatch_threshold"], color="r", ls="--", label="threshold")
        ax.legend()
    ax.set_xlabel("step"), ax.set_title("on-policy logprob mismatch")
    ax = axes[1][1]
    xs = [r["step"] for r in steps]
    bottom = [0.0] * len(steps)
    for phase in ("rollout_wait", "train", "checkpoint", "sync"):
        vals = [r.get(f"{phase}_s", 0.0) for r in steps]  # a restored record lacks some
        ax.bar(xs, vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xlabel("step"), ax.set_ylabel("s"), ax.legend(), ax.set_title("step time")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
