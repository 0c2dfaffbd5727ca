"""The learning demo's terminal view, drawn from the trainer's JSONL log.

Plain functions turn log records into renderables (a progress bar, the step table, an
ASCII chart of reward and held-out accuracy against time); ``LiveView`` tails the log
and redraws them with rich's ``Live``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from services.trainer import checkpoint

CHART_WIDTH, CHART_HEIGHT = 60, 10


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue  # a line being written
    return out


def _kind(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r.get("type") == kind]


def completions(records: list[dict]) -> int:
    return sum(r.get("samples", 0) for r in _kind(records, "step"))


def step_table(records: list[dict], rows: int = 8) -> Table:
    evals = {r["step"]: r["accuracy"] for r in _kind(records, "eval")}
    table = Table(title="training steps (latest)", expand=False, pad_edge=False)
    for col in (
        "step",
        "reward",
        "held-out",
        "loss",
        "clip",
        "|Δ logprob|",
        "staleness",
        "wait/train/sync s",
        "traces",
    ):
        table.add_column(col, justify="right")
    for r in _kind(records, "step")[-rows:]:
        mm = r.get("mismatch_max")
        held = evals.get(r["step"])
        stale = " ".join(f"{k}:{v}" for k, v in (r.get("staleness") or {}).items())
        table.add_row(
            str(r["step"]),
            f"{r['reward_mean']:.3f}",
            "" if held is None else f"{held:.3f}",
            f"{r['loss']:+.3f}",
            f"{r['clip_fraction']:.2f}",
            "-" if mm is None else f"{mm:.1e}",
            stale,
            f"{r['rollout_wait_s']:.1f}/{r['train_s']:.2f}/{r['sync_s']:.2f}",
            str(r.get("samples", 0)),
        )
    return table


def chart(records: list[dict], t0: float, budget: float, target: float) -> Text:
    """Held-out accuracy (●) and training reward (·) against seconds since the start."""
    grid = [[" "] * CHART_WIDTH for _ in range(CHART_HEIGHT + 1)]

    def put(t: float, y: float, mark: str) -> None:
        col = min(CHART_WIDTH - 1, max(0, int((t - t0) / budget * (CHART_WIDTH - 1))))
        row = CHART_HEIGHT - min(CHART_HEIGHT, max(0, round(y * CHART_HEIGHT)))
        if grid[row][col] != "●":
            grid[row][col] = mark

    goal = CHART_HEIGHT - round(target * CHART_HEIGHT)
    grid[goal] = ["-" if c == " " else c for c in grid[goal]]
    for r in _kind(records, "step"):
        put(r["time"], r["reward_mean"], "·")
    for r in _kind(records, "eval"):
        put(r["time"], r["accuracy"], "●")
    text = Text()
    for i, row in enumerate(grid):
        y = (CHART_HEIGHT - i) / CHART_HEIGHT
        label = f"{y:4.1f} |" if i % 2 == 0 else "     |"
        text.append(label + "".join(row) + "\n")
    text.append("     +" + "-" * CHART_WIDTH + "\n")
    text.append(f"      0 s{'':>{CHART_WIDTH - 12}}{budget:.0f} s\n")
    text.append(f"      ● held-out accuracy (greedy)   · training reward   -- target {target}\n")
    return text


def header(records: list[dict], t0: float, budget: float, now: float) -> Table:
    steps, evals = _kind(records, "step"), _kind(records, "eval")
    elapsed = now - t0
    n = completions(records)
    rate = n / max(1e-9, (steps[-1]["time"] - t0)) if steps else 0.0
    held = f"{evals[-1]['accuracy']:.3f} (step {evals[-1]['step']})" if evals else "-"
    line = Text(
        f"{elapsed:4.0f}s / {budget:.0f}s  step {steps[-1]['step'] if steps else 0}  "
        f"held-out {held}  {n} completions ({rate:.0f}/s)"
    )
    grid = Table.grid(padding=(0, 1))
    grid.add_row(ProgressBar(total=budget, completed=min(elapsed, budget), width=24), line)
    return grid


def render(records: list[dict], t0: float, budget: float, target: float, now: float) -> Group:
    return Group(
        header(records, t0, budget, now), step_table(records), chart(records, t0, budget, target)
    )


def reached(records: list[dict], target: float, t0: float) -> tuple[int, float] | None:
    """(step, seconds since the start) of the first held-out accuracy at or over target."""
    for r in _kind(records, "eval"):
        if r["accuracy"] >= target:
            return r["step"], r["time"] - t0
    return None


def final_lines(records: list[dict], target: float, state: Path, t0: float) -> list[str]:
    evals = _kind(records, "eval")
    ck = state / "checkpoints"
    found = checkpoint.latest(ck)
    lines = [
        f"plot: {ck / 'curves.png'}",
        f"trained checkpoint: {found[0] if found else ck}",
        f"trajectories: {state / 'trajectories.jsonl'}   log: {ck / 'log.jsonl'}",
    ]
    best = checkpoint.best(ck)
    if found and best and found[1].best_accuracy is not None:  # as the trainer kept it
        said = f"held-out {found[1].best_accuracy:.3f} at step {found[1].best_step}"
        lines.insert(2, f"best checkpoint: {best} ({said})")
    if not evals:
        return [*lines, "final held-out accuracy: none measured (see trainer.log)"]
    first, last = evals[0], evals[-1]
    hit = reached(records, target, t0)
    lines.append(
        f"held-out accuracy {first['accuracy']:.3f} at step {first['step']} -> "
        f"{last['accuracy']:.3f} at step {last['step']} (best "
        f"{max(e['accuracy'] for e in evals):.3f}); "
        + (
            f"first >= {target} at step {hit[0]}, {hit[1]:.0f}s after the demo started"
            if hit
            else f"never reached {target}"
        )
    )
    smooth = statistics.median(e["accuracy"] for e in evals[-3:])
    lines.append(f"median of the last 3 held-out evaluations: {smooth:.3f}")
    lines.append(f"final held-out accuracy: {last['accuracy']:.3f}")
    return lines


class LiveView:
    def __init__(self, console: Console, budget: float, target: float, log: Path, t0: float):
        self.console, self.budget, self.target, self.log, self.t0 = (
            console,
            budget,
            target,
            log,
            t0,
        )
        self.live = Live(console=console, auto_refresh=False, transient=False)

    def __enter__(self) -> LiveView:
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def refresh(self) -> None:
        records = read_records(self.log)
        self.live.update(
            render(records, self.t0, self.budget, self.target, time.time()), refresh=True
        )
