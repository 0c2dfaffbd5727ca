"""Checkpoints on disk: one Hugging Face directory per step, written whole, then named.

    <checkpoint_dir>/step-000012/   model.safetensors, config + tokenizer files,
                                    optimizer.pt, trainer_state.json
    <checkpoint_dir>/LATEST         "step-000012" (replaced atomically)
    <checkpoint_dir>/BEST           "step-000008": the best held-out accuracy so far
                                    (``keep_best``; never pruned while it is best)

A step directory is written under a temporary name and renamed once complete, and LATEST
is replaced by rename after that, so a crash at any point leaves the previous checkpoint
as the one to resume from. The trainer state (which groups were trained, what is in
flight) lives inside the step's directory: weights and bookkeeping change together.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import msgspec

STATE_FILE = "trainer_state.json"
LATEST = "LATEST"
BEST = "BEST"


class TrainerState(msgspec.Struct, kw_only=True):
    run_id: str
    step: int = 0  # optimizer steps taken; also the weight version the trainer holds
    next_task: int = 0  # the task source's next index (task ids are derived from it)
    trained: list[str] = []  # task ids trained on, each at most once
    in_flight: dict[str, str] = {}  # task id -> "train" | "eval:<step>", submitted, unconsumed
    evals_done: list[int] = []  # steps whose held-out evaluation is recorded
    records: list[dict] = []  # the log records written since the previous checkpoint
    best_step: int | None = None  # the step of the best held-out accuracy so far
    best_accuracy: float | None = None


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def commit_checkpoint(root: Path, state: TrainerState, write_weights) -> Path:
    """Write step ``state.step``: ``write_weights(dir)`` fills the directory, the state is
    added, the directory renamed into place and LATEST pointed at it."""
    root.mkdir(parents=True, exist_ok=True)
    name = step_name(state.step)
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_weights(tmp)
    write_atomic(tmp / STATE_FILE, msgspec.json.encode(state))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    final = root / name
    if final.exists():  # a step re-run after a crash between rename and LATEST
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    write_atomic(root / LATEST, name.encode())
    return final


def latest(root: Path) -> tuple[Path, TrainerState] | None:
    pointer = root / LATEST
    if not pointer.exists():
        return None
    ckpt = root / pointer.read_text().strip()
    state = msgspec.json.decode((ckpt / STATE_FILE).read_bytes(), type=TrainerState)
    return ckpt, state


def improves(state: TrainerState, accuracy: float) -> bool:
    """Whether a held-out accuracy beats the best so far (a tie keeps the earlier step)."""
    return state.best_accuracy is None or accuracy > state.best_accuracy


def mark_best(root: Path, state: TrainerState) -> None:
    """Point BEST at ``state.best_step``; the state (written first) is what prune and a
    resume go by, so a crash before this rename is repaired by calling it again."""
    if state.best_step is not None:
        write_atomic(root / BEST, step_name(state.best_step).encode())


def promote_best(root: Path, state: TrainerState, keep: int) -> None:
    """``mark_best``, then prune: the step that was best is no longer protected, and a
    run's last evaluation has no checkpoint after it to prune it then."""
    mark_best(root, state)
    if state.best_step is not None:
        prune(root, keep, protect=(step_name(state.best_step),))


def best(root: Path) -> Path | None:
    pointer = root / BEST
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if path.is_dir() else None


def prune(root: Path, keep: int, protect: tuple[str, ...] = ()) -> list[Path]:
    """Remove all but the newest ``keep`` step directories (and stale temporaries); never
    LATEST's nor those named in ``protect`` (the best step's)."""
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    doomed = steps[:-keep] + [p for p in root.glob(".tmp-step-*") if p.is_dir()]
    current = (root / LATEST).read_text().strip() if (root / LATEST).exists() else None
    removed = []
    for p in doomed:
        if p.name != current and p.name not in protect:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text("utf-8").splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash mid-write
                continue
    return out
