"""Numbers -> the markdown table (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass

DIRECT = "direct"


@dataclass(frozen=True)
class Run:
    target: str  # direct | polar-chat | polar-token | litellm
    stream: bool
    sessions: int
    latencies: list[float]  # seconds
    wall: float
    bad: int
    cpu: float | None = None  # CPU seconds of the proxy's processes during the run
    cpu_with_bus: float | None = None  # ... plus nats-server and valkey

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall

    @property
    def per_cpu(self) -> float | None:
        return len(self.latencies) / self.cpu if self.cpu else None

    @property
    def per_cpu_with_bus(self) -> float | None:
        return len(self.latencies) / self.cpu_with_bus if self.cpu_with_bus else None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def added(run: Run, direct: Run, q: float) -> float:
    return percentile(run.latencies, q) - percentile(direct.latencies, q)


def table(runs: list[Run], targets: list[str]) -> str:
    """One row per (stream, sessions); per proxy: added p50/p99, req/s, req per CPU-s."""
    by_key = {(r.target, r.stream, r.sessions): r for r in runs}
    head = ["stream", "sessions", "direct p50 / p99 ms", "direct req/s"]
    for t in targets:
        head += [f"{t} added p50 / p99 ms", f"{t} req/s", f"{t} req per CPU-s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = sorted({(r.stream, r.sessions) for r in runs})
    for stream, sessions in keys:
        direct = by_key.get((DIRECT, stream, sessions))
        if direct is None:
            continue
        p50, p99 = percentile(direct.latencies, 50), percentile(direct.latencies, 99)
        cells = ["yes" if stream else "no", str(sessions), f"{ms(p50)} / {ms(p99)}"]
        cells.append(f"{direct.rps:.0f}")
        for t in targets:
            cells += _target_cells(by_key.get((t, stream, sessions)), direct)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _target_cells(run: Run | None, direct: Run) -> list[str]:
    if run is None:
        return ["-", "-", "-"]
    lat = f"{ms(added(run, direct, 50))} / {ms(added(run, direct, 99))}"
    per_cpu = f"{run.per_cpu:.0f}" if run.per_cpu else "-"
    if run.per_cpu_with_bus:
        per_cpu += f" ({run.per_cpu_with_bus:.0f})"
    return [lat, f"{run.rps:.0f}", per_cpu]


def latency_lines(runs: list[Run]) -> str:
    """Absolute p50/p99 of every run, for the record."""
    out = ["| target | stream | sessions | requests | bad | p50 ms | p99 ms | req/s |"]
    out.append("|---|---|---|---|---|---|---|---|")
    for r in runs:
        out.append(
            f"| {r.target} | {'yes' if r.stream else 'no'} | {r.sessions} | {len(r.latencies)}"
            f" | {r.bad} | {ms(percentile(r.latencies, 50))} | {ms(percentile(r.latencies, 99))}"
            f" | {r.rps:.0f} |"
        )
    return "\n".join(out)
