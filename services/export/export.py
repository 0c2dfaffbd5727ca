"""``polar export``: stored trajectories -> an SFT corpus or Slime samples, JSONL or Parquet."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from schemas import Trajectory
from schemas import subjects as S
from schemas.routing import routing_array
from services.client.client import routing_blobs
from services.common.bus import Bus
from services.common.redact import redact_struct
from services.export.layouts import LAYOUTS, Numbering
from services.export.reader import read_stored, read_trajectories
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
    regrade: str | None = None,
) -> ExportStats:
    """Write every stored trajectory of ``task_id`` (all tasks if None) in ``layout``.
    ``min_reward``: sft keeps sessions at or above it (default 1.0); slime filters only
    when it is given. ``regrade``: that re-grade's trajectories (``polar regrade``: the
    same tokens, its rewards) instead of the sessions' own."""
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
        async for t in _stored(bus, task_id, regrade, stats.unreadable):
            stats.trajectories += 1
            rows = to_rows(redact_struct(t), threshold, numbering)  # also pre-redaction ones
            if rows and any("rollout_routed_experts" in r for r in rows):
                await write_routing(bus, t, rows, out.parent)
            if rows:
                stats.exported += 1
                stats.rows += len(rows)
                writer.write(rows)
    finally:
        writer.close()
    return stats


async def _stored(
    bus: Bus, task_id: str | None, regrade: str | None, unreadable: list[str]
) -> AsyncIterator[Trajectory]:
    if regrade is None:
        async for t in read_trajectories(bus, task_id, unreadable=unreadable):
            yield t
        return
    subject = S.regrades(regrade, task_id or ">")
    async for t, _ in read_stored(bus, S.STREAM_REGRADES, subject, unreadable=unreadable):
        yield t


async def write_routing(bus: Bus, t: Trajectory, rows: list[dict], folder: Path) -> None:
    """Each slime row's MoE routing as the ``.npy`` its ``rollout_routed_experts`` names:
    slime's ``Sample.rollout_routed_experts`` (``np.load`` it)."""
    import numpy as np

    blobs = await routing_blobs(bus, t.traces)
    for row in rows:
        name = row.get("rollout_routed_experts")
        if name is None:
            continue
        trace = t.traces[row["trace_index"]]
        assert trace.routing is not None
        n = len(row["tokens"])
        experts, _ = routing_array(trace.routing, n, blobs)
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, experts[: n - 1], allow_pickle=False)
