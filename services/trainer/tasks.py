"""The task source: templates from a JSONL file or a ``module:function``, a held-out split,
and a deterministic order, so task ``i`` of a run is the same task after a restart (its
id is derived from ``i`` and resubmitting it is a no-op for the scheduler)."""

from __future__ import annotations

import copy
import importlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import msgspec

from schemas import TaskRequest
from services.trainer.config import ConfigError, TaskSourceConfig


def read_jsonl(path: str | Path) -> list[dict]:
    p = Path(path)
    try:
        lines = p.read_text("utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"tasks: cannot read {p}: {exc.strerror}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p}:{n}: not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{p}:{n}: a task template is a JSON object")
        out.append(obj)
    return out


def call_generator(target: str, args: dict) -> list[dict]:
    module, _, name = target.partition(":")
    if not module or not name:
        raise ConfigError(f"tasks.generator {target!r}: expected 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"tasks.generator {target!r} cannot be loaded ({exc}); is the module importable?"
        ) from None
    items = list(fn(**args))
    bad = [i for i, t in enumerate(items) if not isinstance(t, dict)]
    if bad:
        raise ConfigError(f"tasks.generator {target!r}: item {bad[0]} is not a dict")
    return items


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = (
            deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def check_template(template: dict, where: str) -> None:
    """A template must be a valid TaskRequest (with any task id): fail at start, not mid-run."""
    try:
        msgspec.convert({**template, "task_id": "check"}, TaskRequest)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: not a valid task: {exc}") from None


@dataclass(frozen=True)
class TaskSource:
    train: list[dict]
    heldout: list[dict]
    seed: int

    @classmethod
    def load(cls, cfg: TaskSourceConfig, seed: int) -> TaskSource:
        items = read_jsonl(cfg.path) if cfg.path else call_generator(cfg.generator, cfg.args)
        if cfg.heldout_path:
            train, heldout = items, read_jsonl(cfg.heldout_path)
        else:
            train, heldout = split(items, cfg.heldout, seed)
        if not train:
            raise ConfigError("tasks: no training templates left after the held-out split")
        for i, t in enumerate(train):
            check_template(t, f"tasks: training template {i}")
        for i, t in enumerate(heldout):
            check_template(t, f"tasks: held-out template {i}")
        return cls(train, heldout, seed)

    def train_task(self, index: int) -> dict:
        """The ``index``-th training template: epochs of seeded shuffles of the train set."""
        n = len(self.train)
        epoch, pos = divmod(index, n)
        order = list(range(n))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return self.train[order[pos]]


def split(items: list[dict], heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out): ``heldout`` templates chosen by ``seed``, both in source order."""
    if heldout >= len(items) and heldout:
        raise ConfigError(f"tasks: heldout={heldout} leaves no training template of {len(items)}")
    chosen = set(random.Random(seed).sample(range(len(items)), heldout))
    train = [t for i, t in enumerate(items) if i not in chosen]
    return train, [t for i, t in enumerate(items) if i in chosen]


def task_id(run_id: str, kind: str, step: int, index: int) -> str:
    """``<run>-t<i>`` for training task i, ``<run>-e<step>-<i>`` for held-out task i of
    the evaluation at ``step``."""
    return f"{run_id}-t{index}" if kind == "train" else f"{run_id}-e{step}-{index}"


def make_task(
    template: dict, tid: str, num_samples: int, metadata: dict, over: dict | None = None
) -> dict:
    task = deep_merge(template, over or {})
    task["task_id"] = tid
    task["num_samples"] = num_samples
    task["metadata"] = {**task.get("metadata", {}), **metadata}
    return task
