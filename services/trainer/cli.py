"""``polar train CONFIG``: one training run in the foreground; exit status 0 when done,
1 for a configuration error or a stack it cannot sign in to, 3 when the run failed (e.g.
the logprob mismatch check).

Where the stack is (NATS, Redis, the proxy, the admin token) comes from the config, and
for every key it leaves out from ``connection``: the stack ``polar train -t`` names
(``services/cli``), else the environment (``services.client.connection``)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

from services.client.connection import Connection, EnvFileError, from_environment
from services.common.bus import CredentialsRefused, GaveUp
from services.trainer.checkpoint import TrainerState, latest, step_name
from services.trainer.config import ConfigError, TrainerConfig, load_config, stack_defaults
from services.trainer.loop import run_training

FAILED_EXIT = 3
INTERRUPTED_EXIT = 130  # a shell's code for a Ctrl-C


def _print(rec: dict) -> None:
    if rec["type"] == "step":
        mm = rec["mismatch_max"]
        print(
            f"step {rec['step']:>4}  reward {rec['reward_mean']:.3f}  loss {rec['loss']:+.4f}  "
            f"clip {rec['clip_fraction']:.3f}  mismatch {'-' if mm is None else f'{mm:.1e}'}  "
            f"wait {rec['rollout_wait_s']:.1f}s train {rec['train_s']:.2f}s "
            f"sync {rec['sync_s']:.2f}s",
            flush=True,
        )
    elif rec["type"] == "resume":
        print(resume_line(rec), flush=True)
    elif rec["type"] == "eval":
        best = " (best so far)" if rec.get("best") else ""
        print(
            f"eval at step {rec['step']}: held-out accuracy {rec['accuracy']:.3f}{best}",
            flush=True,
        )


def resume_line(rec: dict) -> str:
    """The first thing a rerun of the same command says: where it goes on from."""
    line = f"resumed from {rec['checkpoint']} (step {rec['step']}, {rec['trained_groups']} groups trained"
    if rec.get("in_flight"):
        line += f", {rec['in_flight']} groups still in flight"
    return line + ")"


def interrupted_line(cfg: TrainerConfig) -> str:
    found = latest(Path(cfg.checkpoint_dir))
    if found is None:
        return "interrupted before the first checkpoint: nothing to resume from"
    ckpt, state = found
    return (
        f"interrupted; the last checkpoint is {ckpt.name} (step {state.step} of "
        f"{cfg.steps}): the same command resumes from it"
    )


def done_line(state: TrainerState, cfg: TrainerConfig) -> str:
    line = f"done: {state.step} steps; log {cfg.log_file}, plot {cfg.plot_file}"
    if cfg.keep_best and state.best_step is not None:
        path = Path(cfg.checkpoint_dir) / step_name(state.best_step)
        line += f"; best held-out {state.best_accuracy:.3f} at step {state.best_step}: {path}"
    return line


def main(
    path: str,
    connection: Connection | None = None,
    on_start: Callable[[TrainerConfig], None] | None = None,
) -> int:
    """``on_start``: called with the config before the run starts (``polar train``
    registers the run with its stack there)."""
    try:
        conn = from_environment() if connection is None else connection
        cfg = load_config(path, stack_defaults(conn))
    except (ConfigError, EnvFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if on_start is not None:
        on_start(cfg)
    try:
        state = asyncio.run(run_training(cfg, _print))
    except KeyboardInterrupt:  # asyncio.run cancelled the run: its connections are closed
        print(interrupted_line(cfg), file=sys.stderr)
        return INTERRUPTED_EXIT
    except (ConfigError, CredentialsRefused, GaveUp) as exc:  # before its first step
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a failed run is an exit status, with the reason
        print(f"training failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return FAILED_EXIT
    print(done_line(state, cfg))
    return 0
