"""Numbers -> the markdown table and the verdicts on the issue's targets (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass

DIRECT = "direct"
LITELLM = "litellm"
RLLM = "rllm-gateway"
PEERS = (LITELLM, RLLM)  # the other proxies, which the targets are measured against
FIRST_CALLS = "first calls"


@dataclass(frozen=True)
class Run:
    target: str  # direct | polar-chat | polar-token[+uvloop] | litellm | rllm-gateway
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


HEAD = (
    "| stream | sessions | path | requests (bad) | p50 ms | p99 ms | added p50 ms | added p99 ms"
    " | req/s | req per CPU-s (+NATS, Valkey) |"
)


def table(runs: list[Run]) -> str:
    """One row per run, grouped by (stream, sessions), each next to its direct call."""
    direct = {(r.stream, r.sessions): r for r in runs if r.target == DIRECT}
    lines = [HEAD, "|" + "---|" * HEAD.count(" | ") + "---|"]
    for r in sorted(runs, key=lambda r: (r.stream, r.sessions)):
        base = direct.get((r.stream, r.sessions))
        lines.append("| " + " | ".join(_cells(r, base)) + " |")
    return "\n".join(lines)


def _cells(r: Run, base: Run | None) -> list[str]:
    extra = ["-", "-"]
    if base is not None and r.target != DIRECT:
        extra = [ms(added(r, base, 50)), ms(added(r, base, 99))]
    per_cpu = f"{r.per_cpu:.0f}" if r.per_cpu else "-"
    if r.per_cpu_with_bus:
        per_cpu += f" ({r.per_cpu_with_bus:.0f})"
    return [
        "yes" if r.stream else "no",
        str(r.sessions),
        r.target,
        f"{len(r.latencies)} ({r.bad})",
        ms(percentile(r.latencies, 50)),
        ms(percentile(r.latencies, 99)),
        *extra,
        f"{r.rps:.0f}",
        per_cpu,
    ]


def verdicts(runs: list[Run]) -> list[str]:
    """The issues' targets: added p50 <= 1 ms at one session; >= 10x each peer's
    requests per second on the same cores (best req per CPU-s of any cell, each side)."""
    direct = {(r.stream, r.sessions): r for r in runs if r.target == DIRECT}
    out = []
    for r in runs:
        base = direct.get((r.stream, r.sessions))
        if r.sessions == 1 and r.target != DIRECT and base is not None:
            a = added(r, base, 50) * 1000
            kind = "streaming" if r.stream else "non-streaming"
            out.append(
                f"added p50 at 1 session, {kind}, {r.target}: {a:.2f} ms "
                f"({'meets' if a <= 1.0 else 'misses'} <= 1 ms)"
            )
    best = {}
    for r in runs:
        if r.per_cpu and not r.target.endswith(FIRST_CALLS):  # those are one call at a time
            best[r.target] = max(best.get(r.target, 0.0), r.per_cpu)
    for peer in (p for p in PEERS if p in best):
        for target, value in best.items():
            if target not in PEERS:
                ratio = value / best[peer]
                out.append(
                    f"max req per CPU-s, {target}: {value:.0f} = {ratio:.1f}x {peer}'s "
                    f"{best[peer]:.0f} ({'meets' if ratio >= 10 else 'misses'} >= 10x)"
                )
    return out + cell_ratios(runs)


def cell_ratios(runs: list[Run]) -> list[str]:
    """Each path's req per CPU-s over each peer's in the same cell (same streaming, same
    sessions): the comparison at equal load, beside the best-cell one above."""
    cells: dict[tuple[bool, int], dict[str, float]] = {}
    for r in runs:
        if r.per_cpu and not r.target.endswith(FIRST_CALLS):
            cells.setdefault((r.stream, r.sessions), {})[r.target] = r.per_cpu
    out = []
    for peer in PEERS:
        for (stream, sessions), cell in sorted(cells.items()):
            if peer not in cell:
                continue
            ratios = ", ".join(
                f"{t} {v / cell[peer]:.1f}x" for t, v in cell.items() if t not in PEERS
            )
            kind = "streaming" if stream else "non-streaming"
            out.append(f"req per CPU-s over {peer}'s, {sessions} sessions, {kind}: {ratios}")
    return out
