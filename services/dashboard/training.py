"""The training page: curves by step from the trainer's JSONL log
(``services/trainer/loop.py`` writes it, ``services/trainer/metrics.py`` appends), each
with a label a reader knows, and the run's state. Pure: the caller reads the log and asks
the trainer service how it is (``service``: its ``/healthz`` run check, when the stack
runs one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import orjson

Record = dict[str, Any]


class Curve(NamedTuple):
    key: str  # the page's id of the panel (figure[data-curve=...])
    label: str  # what the panel is titled
    kind: str  # "step" or "eval": which records it is drawn from
    value: Callable[[Record], Any]
    optional: bool = False  # shown only when the log has points for it


def mean_staleness(ages: Mapping[str, Any]) -> float | None:
    """Mean age (trainer version minus the sampling version) of a step's samples."""
    total = n = 0.0
    for age, count in ages.items():
        try:
            total += float(age) * float(count)
            n += float(count)
        except (TypeError, ValueError):
            continue
    return total / n if n else None


CURVES = (
    Curve("reward", "mean reward (training groups)", "step", lambda r: r.get("reward_mean")),
    Curve("heldout_accuracy", "held-out accuracy", "eval", lambda r: r.get("accuracy")),
    Curve("loss", "loss", "step", lambda r: r.get("loss")),
    Curve(
        "staleness",
        "mean staleness (versions behind)",
        "step",
        lambda r: mean_staleness(r.get("staleness") or {}),
    ),
    Curve(
        "mismatch",
        "max logprob mismatch |Δ| (trainer vs engine)",
        "step",
        lambda r: r.get("mismatch_max"),
    ),
    Curve(
        "clip_fraction", "clipped token fraction", "step", lambda r: r.get("clip_fraction"), True
    ),
    Curve("kl", "KL(behaviour ‖ current)", "step", lambda r: r.get("kl"), True),
    Curve(
        "grad_norm", "gradient norm (before clipping)", "step", lambda r: r.get("grad_norm"), True
    ),
)


def parse_jsonl(lines: Iterable[bytes]) -> list[Record]:
    out = []
    for line in lines:
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a line being written right now
        if isinstance(rec, dict):
            out.append(rec)
    return out


def run_state(records: list[Record], service: Mapping[str, Any] | None) -> dict[str, Any]:
    """``running``, ``done`` or ``failed`` (with why): the log's last ``done`` or ``error``
    record after its last ``resume``, else what the trainer service says of its run."""
    state: dict[str, Any] = {"state": "running", "detail": None}
    for r in records:
        kind = r.get("type")
        if kind == "resume":
            state = {"state": "running", "detail": None}
        elif kind == "done":
            state = {"state": "done", "detail": None}
        elif kind == "error":
            state = {"state": "failed", "detail": r.get("error")}
    if state["state"] == "running" and service:
        if service.get("error"):
            state = {"state": "failed", "detail": service["error"]}
        elif service.get("done"):
            state = {"state": "done", "detail": None}
    return state


def training_view(records: list[Record], service: Mapping[str, Any] | None = None) -> dict:
    """Curves by step; by step, the last record wins (a step redone after a restart)."""
    rows: dict[str, dict[int, Record]] = {"step": {}, "eval": {}}
    for r in records:
        kind, step = r.get("type"), r.get("step")
        if isinstance(step, int) and kind in rows:
            rows[kind][step] = r

    def series(curve: Curve) -> list[list[Any]]:
        by_step = rows[curve.kind]
        return [
            [s, v] for s in sorted(by_step) if isinstance(v := curve.value(by_step[s]), int | float)
        ]

    curves = [(c, series(c)) for c in CURVES]
    steps = rows["step"]
    return {
        "steps": len(steps),
        "last_step": max(steps) if steps else None,
        **run_state(records, service),
        "curves": {c.key: points for c, points in curves if points or not c.optional},
        "labels": {c.key: c.label for c in CURVES},
    }
