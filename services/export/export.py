"""``polar export``: stored trajectories -> an SFT corpus or Slime samples, JSONL or Parquet."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.common.bus import Bus
from services.common.redact import redact_struct
from services.export.layouts import LAYOUTS, Numbering
from services.export.reader import read_trajectories
from services.export.writers import WRITERS, ExportError


@dataclass
class ExportStats:
    trajectories: int = 0  # read from the stream
    exported: int = 0  # trajectories that gave at least one row
    rows: int = 0
    unreadable: list[str] = field(default_factory=list)


async def export(
    bus: Bus,
    out: Path,
    *,
    layout: str = "sft",
    fmt: str = "jsonl",
    task_id: str | None = None,
    min_reward: float | None = None,
) -> ExportStats:
    """Write every stored trajectory of ``task_id`` (all tasks if None) in ``layout``.
    ``min_reward``: sft keeps sessions at or above it (default 1.0); slime filters only
    when it is given."""
    if layout not in LAYOUTS:
        raise ExportError(f"unknown layout {layout!r}: use one of {sorted(LAYOUTS)}")
    if fmt not in WRITERS:
        raise ExportError(f"unknown format {fmt!r}: use one of {sorted(WRITERS)}")
    to_rows = LAYOUTS[layout]
    threshold = 1.0 if layout == "sft" and min_reward is None else min_reward
    stats, numbering = ExportStats(), Numbering()
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = WRITERS[fmt](out, layout)
    try:
        async for t in read_trajectories(bus, task_id, unreadable=stats.unreadable):
            stats.trajectories += 1
            rows = to_rows(redact_struct(t), threshold, numbering)  # also pre-redaction ones
            if rows:
                stats.exported += 1
                stats.rows += len(rows)
                writer.write(rows)
    finally:
        writer.close()
    return stats
