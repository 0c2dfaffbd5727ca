"""The learning demo for several seeds: held-out accuracy against wall-clock time.

Runs ``polar demo`` (services/demo/run.py, its default recipe) once per seed, one after
the other, each with its own stack, then plots every seed's held-out curve against
seconds since that demo's start (docs/img/learning-seeds.png) and prints one row per
seed: step-0 accuracy, when 0.6 was first reached, the final accuracy, steps,
completions/s, the step time split.

    python tests/bench/bench_learning.py --seeds 0 1 2 --out /tmp/learn
    python tests/bench/bench_learning.py --replot /tmp/learn   # plot existing runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from rich.console import Console

from services.demo.run import Recipe, run
from services.demo.view import read_records

PLOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "learning-seeds.png"


def summary(seed_dir: Path, target: float) -> dict:
    records = read_records(seed_dir / "checkpoints" / "log.jsonl")
    meta = json.loads((seed_dir / "bench.json").read_text())
    t0 = meta["started"]
    steps = [r for r in records if r["type"] == "step"]
    evals = [r for r in records if r["type"] == "eval"]
    hit = next((e for e in evals if e["accuracy"] >= target), None)
    done = steps[-1]["time"] - t0 if steps else 0.0
    first_step = steps[0]["time"] - steps[0]["step_s"] - t0 if steps else 0.0
    samples = sum(s["samples"] for s in steps)
    return {
        "seed": meta["seed"],
        "acc_step0": evals[0]["accuracy"] if evals else None,
        "reached_s": None if hit is None else round(hit["time"] - t0, 1),
        "reached_step": None if hit is None else hit["step"],
        "final_acc": evals[-1]["accuracy"] if evals else None,
        "best_acc": max((e["accuracy"] for e in evals), default=None),
        "steps": len(steps),
        "rl_start_s": round(first_step, 1),
        "completions": samples,
        "completions_per_s": round(samples / max(1e-9, done - first_step), 1),
        "step_s": round(statistics.median(s["step_s"] for s in steps), 2) if steps else None,
        "train_s": round(statistics.median(s["train_s"] for s in steps), 2) if steps else None,
        "wait_s": round(statistics.median(s["rollout_wait_s"] for s in steps), 2)
        if steps
        else None,
        "sync_s": round(statistics.median(s["sync_s"] for s in steps), 3) if steps else None,
        "checkpoint_s": round(statistics.median(s["checkpoint_s"] for s in steps), 3)
        if steps
        else None,
        "demo_wall_s": round(meta["ended"] - t0, 1) if "ended" in meta else None,
        "load": meta.get("load"),
        "curve": [(round(e["time"] - t0, 1), e["step"], round(e["accuracy"], 3)) for e in evals],
    }


def table(rows: list[dict], target: float) -> list[str]:
    """The rows as the Markdown table docs/benchmarks/index.md shows."""
    out = [
        f"| seed | held-out at step 0 | first >= {target} (s since the demo's start, step) "
        "| best | final | steps | median step / train / wait / checkpoint / sync s "
        "| demo wall | load avg at start |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hit = (
            "not reached"
            if r["reached_s"] is None
            else f"{r['reached_s']:.0f} s, step {r['reached_step']}"
        )
        split = " / ".join(
            str(r[k]) for k in ("step_s", "train_s", "wait_s", "checkpoint_s", "sync_s")
        )
        wall = "-" if r["demo_wall_s"] is None else f"{r['demo_wall_s']:.0f} s"
        load = "-" if not r["load"] else f"{r['load'][0]:.1f}"
        out.append(
            f"| {r['seed']} | {r['acc_step0']:.3f} | {hit} | {r['best_acc']:.3f} "
            f"| {r['final_acc']:.3f} | {r['steps']} | {split} | {wall} | {load} |"
        )
    reached = sum(r["reached_s"] is not None and r["reached_s"] <= 300 for r in rows)
    out.append("")
    out.append(f"{reached} of {len(rows)} seeds reached {target} within 300 s.")
    return out


def plot(rows: list[dict], out: Path, target: float, budget: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        xs = [t for t, _, _ in r["curve"]]
        ys = [a for _, _, a in r["curve"]]
        ax.plot(xs, ys, "o-", ms=3, label=f"seed {r['seed']}")
    ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target}")
    ax.axvline(300, color="r", ls=":", lw=1, label="5 minutes")
    ax.set_xlabel("seconds since `polar demo` started (stack start-up and warm start included)")
    ax.set_ylabel("held-out accuracy (greedy, 108 lines)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlim(0, max(budget, 310))
    ax.legend(loc="upper left")
    ax.set_title("the learning demo through the whole stack")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=Path("/tmp/polar-bench-learning"))
    ap.add_argument("--replot", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=PLOT)
    args = ap.parse_args()
    recipe = Recipe()
    root = args.replot or args.out
    if args.replot is None:
        for seed in args.seeds:
            seed_dir = root / f"seed{seed}"

            meta = {"seed": seed, "started": time.time(), "load": os.getloadavg()}
            seed_dir.mkdir(parents=True, exist_ok=True)
            (seed_dir / "bench.json").write_text(json.dumps(meta))
            run(Console(), Recipe(seed=seed), seed_dir)
            meta["ended"] = time.time()
            (seed_dir / "bench.json").write_text(json.dumps(meta))
    rows = [summary(d, recipe.target) for d in sorted(root.glob("seed*"))]
    for r in rows:
        print(json.dumps(r))
    print("\n".join(table(rows, recipe.target)))
    for r in rows:
        curve = ", ".join(f"({t:.0f}, {st}, {a:.2f})" for t, st, a in r["curve"])
        print(f"seed {r['seed']} curve (s, step, acc): {curve}")
    plot(rows, args.plot, recipe.target, recipe.budget_seconds)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
