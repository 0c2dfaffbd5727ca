"""Trainer benchmark: the closed loop through the whole stack, synchronous
(``rollout_ahead=0``) against asynchronous (``rollout_ahead>0``), side by side in one run
on one stack. Plain script:

    python tests/bench/bench_trainer.py [--steps 8] [--groups 4] [--group-size 4]
                                        [--ahead 4] [--max-run 8] [--max-tokens 8]

Per mode: the step time split (rollout wait / train / checkpoint / weight sync), the
engine's busy fraction (``sglang:num_running_reqs > 0`` sampled every 20 ms from its
/metrics while the run steps), sampled tokens and groups per second, and staleness.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402

from infra import devstack  # noqa: E402
from services.trainer import checkpoint as ck  # noqa: E402
from services.trainer.config import parse_config  # noqa: E402
from services.trainer.loop import run_training  # noqa: E402
from tests.helpers.trainer_stack import agent_template, start_stack, trainer_config  # noqa: E402


class BusyProbe:
    """Samples the engine's running-request gauge in a thread."""

    def __init__(self, url: str, period: float = 0.02) -> None:
        self.url, self.period = f"{url}/metrics", period
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(trust_env=False, timeout=1) as client:
            while not self._stop.is_set():
                try:
                    text = client.get(self.url).text
                    line = next(x for x in text.splitlines() if x.startswith("sglang:num_running"))
                    self.samples.append(int(float(line.split()[-1])))
                except (httpx.HTTPError, StopIteration, ValueError):
                    pass
                time.sleep(self.period)

    def __enter__(self) -> BusyProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def busy(self) -> float:
        return sum(1 for s in self.samples if s > 0) / max(1, len(self.samples))


def run_mode(topo, model_dir, proxy_url, out: Path, args, ahead: int, engine_url: str) -> dict:
    raw = trainer_config(
        topo,
        model_dir,
        proxy_url,
        out,
        run_id=f"bench{ahead}",
        steps=args.steps,
        groups_per_step=args.groups,
        group_size=args.group_size,
        rollout_ahead=ahead,
        max_staleness=args.steps,
        lr=1e-4,
    )
    cfg = parse_config(raw)
    with BusyProbe(engine_url) as probe:
        t0 = time.perf_counter()
        asyncio.run(run_training(cfg))
        wall = time.perf_counter() - t0
    steps = [r for r in ck.read_log(cfg.log_file) if r["type"] == "step"]
    mean = lambda k: statistics.fmean(r[k] for r in steps)  # noqa: E731
    stale = {}
    for r in steps:
        for k, v in r["staleness"].items():
            stale[k] = stale.get(k, 0) + v
    return {
        "ahead": ahead,
        "wall_s": wall,
        "step_s": mean("step_s"),
        "rollout_wait_s": mean("rollout_wait_s"),
        "train_s": mean("train_s"),
        "checkpoint_s": mean("checkpoint_s"),
        "sync_s": mean("sync_s"),
        "engine_busy": probe.busy,
        "sampled_tokens_per_s": sum(r["sampled_tokens"] for r in steps) / wall,
        "groups_per_s": sum(len(r["groups"]) for r in steps) / wall,
        "staleness": stale,
        "mismatch_max": max((r["mismatch_max"] or 0.0) for r in steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--ahead", type=int, default=4)
    ap.add_argument("--max-run", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    state = Path(tempfile.mkdtemp(prefix="polar-bench-trainer-"))
    topo, model_dir, proxy_url = start_stack(state, max_run=args.max_run)
    engine_url = topo.backends[0].url
    try:
        results = []
        for ahead in (0, args.ahead):
            out = state / f"ahead{ahead}"
            out.mkdir()
            words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
            (out / "tasks.jsonl").write_text(
                "".join(
                    json.dumps(agent_template(f"say {w}", args.max_tokens)) + "\n" for w in words
                )
            )
            results.append(run_mode(topo, model_dir, proxy_url, out, args, ahead, engine_url))
    finally:
        devstack.down(state)
    sync, asyn = results
    print(
        f"trainer bench: {args.steps} steps x {args.groups} groups x {args.group_size} samples, "
        f"max_run {args.max_run}, {args.max_tokens} tokens per answer"
    )
    keys = [
        "wall_s",
        "step_s",
        "rollout_wait_s",
        "train_s",
        "checkpoint_s",
        "sync_s",
        "engine_busy",
        "sampled_tokens_per_s",
        "groups_per_s",
        "mismatch_max",
    ]
    print(f"{'':22}{'ahead=0':>12}{f'ahead={args.ahead}':>12}{'ratio':>10}")
    for k in keys:
        a, b = sync[k], asyn[k]
        ratio = f"{b / a:.2f}x" if a else "-"
        fmt = ".2e" if k == "mismatch_max" else ".3f"
        print(f"{k:22}{a:>12{fmt}}{b:>12{fmt}}{ratio:>10}")
    print(f"{'staleness':22}{str(sync['staleness']):>12}  {asyn['staleness']}")


if __name__ == "__main__":
    main()
