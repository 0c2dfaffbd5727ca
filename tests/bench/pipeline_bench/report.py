"""The benchmark's tables (markdown, for docs/benchmarks/) and the py-spy summary."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

PROCESSES = (
    "scheduler",
    "pool",
    "executor",
    "builder",
    "evaluator",
    "proxy",
    "nats-server",
    "valkey",
    "instant engine",
)


def _cols(runs: list[dict]) -> str:
    head = "| | " + " | ".join(f"{r['tree'].split(':')[0]} {r['variant']}" for r in runs) + " |"
    return head + "\n|---|" + "---|" * len(runs)


def _row(name: str, runs: list[dict], cell) -> str:
    return f"| {name} | " + " | ".join(cell(r) for r in runs) + " |"


def throughput(runs: list[dict]) -> list[str]:
    lines = [_cols(runs)]
    lines.append(_row("sessions", runs, lambda r: str(r["sessions"])))
    lines.append(_row("**sessions/s**", runs, lambda r: f"**{r['sessions_per_s']:.1f}**"))
    for key, what in (("submit", "submit -> commit"), ("init", "INITIALIZING -> commit")):
        lines.append(
            _row(
                f"{what} p50 / p99 ms",
                runs,
                lambda r, k=key: (
                    f"{r['latency_ms'][k + '_p50']:.0f} / {r['latency_ms'][k + '_p99']:.0f}"
                ),
            )
        )
    total = {id(r): sum(sum(v) for v in r["cpu_ms"].values()) for r in runs}
    lines.append(
        _row("**CPU ms / session, all processes**", runs, lambda r: f"**{total[id(r)]:.1f}**")
    )
    for proc in PROCESSES:
        lines.append(_row(f"{proc} (own + children)", runs, lambda r, p=proc: _cpu(r, p)))
    lines.append(
        _row(
            "bench client (submit + TrajectoryClient)", runs, lambda r: f"{r['client_cpu_ms']:.1f}"
        )
    )
    lines.append(_row("Valkey commands / session", runs, lambda r: f"{r['redis_commands']:.0f}"))
    lines.append(_row("outcomes", runs, lambda r: _counts(r["outcomes"])))
    lines.append(_row("traces per trajectory", runs, lambda r: _counts(r["traces"])))
    lines.append(_row("load average (1 min) after", runs, lambda r: f"{r['load_average'][0]:.1f}"))
    return lines


def _cpu(r: dict, proc: str) -> str:
    own, children = r["cpu_ms"].get(proc, (0.0, 0.0))
    return f"{own:.1f}" + (f" + {children:.1f}" if children >= 0.05 else "")


def _counts(c: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(c.items()))


def storage(runs: list[dict]) -> list[str]:
    """Memory: each process's resident set, Valkey's and the streams' growth per session."""
    lines = [_cols(runs)]
    lines.append(
        _row("Valkey used_memory, bytes / session", runs, lambda r: f"{r['redis_bytes']:.0f}")
    )
    lines += _pair_rows(runs, "rss_mb", PROCESSES, "{} RSS MB, before -> after", "{:.0f} -> {:.0f}")
    streams = sorted({s for r in runs for s in r["streams"]})
    lines += _pair_rows(
        runs, "streams", streams, "{}: messages / bytes per session", "{:.1f} / {:.0f}"
    )
    return lines


def _pair_rows(runs: list[dict], field: str, names, label: str, cell: str) -> list[str]:
    """One row per name of a field holding a pair per name (0, 0 where a run lacks it)."""
    return [
        _row(label.format(n), runs, lambda r, n=n: cell.format(*r[field].get(n, (0, 0))))
        for n in names
    ]


def kept_keys(label: str, kept: dict) -> list[str]:
    lines = [
        f"Left in Valkey after the runs ({label}):",
        "",
        "| key family | keys | without TTL | mean bytes (MEMORY USAGE) |",
        "|---|---|---|---|",
    ]
    for fam, k in kept["keys"].items():
        lines.append(
            f"| `{fam}` | {k['keys']} | {k['no_ttl_fraction']:.0%} | {k['mean_bytes']:.0f} |"
        )
    lines += [
        "",
        "| stream | retention | max age | max bytes | max msgs | max per subject |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in kept["streams"].items():
        lines.append(
            f"| {name} | {s['retention']} | {s['max_age_days']:g} d | {s['max_bytes']} "
            f"| {s['max_msgs']} | {s['max_msgs_per_subject']} |"
        )
    return lines


def markdown(meta: dict, runs: list[dict], kept: list[dict], labels: list[str]) -> str:
    out = [
        f"### Pipeline ({meta['when']}; {meta['cpus']} CPUs, nice {meta['nice']}; "
        f"node {'/'.join(map(str, meta['bounds']))}; tasks of {meta['group']})",
        "",
    ]
    out += [f"- {label}" for label in labels] + [""]
    out += throughput(runs) + ["", *storage(runs), ""]
    for label, k in zip(labels, kept, strict=True):
        out += kept_keys(label.split(":")[0], k) + [""]
    for r in runs:
        for service, path in r.get("profiles", {}).items():
            out += [f"py-spy on {service}, {r['variant']} ({r['tree'].split(':')[0]}):", ""]
            out += profile_table(Path(path)) + [""]
    return "\n".join(out)


PROJECT = ("services/", "proxy/", "schemas/", "evaluators/", "infra/")
LAUNCHER = ("services/cli/main.py", "services/common/http.py")  # granian's start-up chain


def profile_table(raw: Path, top: int = 20) -> list[str]:
    """py-spy's raw stacks (``frame;frame;... count``, recorded with ``--gil``: only the
    thread holding the GIL is sampled, so the samples are the service's Python CPU):
    each project function's share inclusive (anywhere on the stack) and as the deepest
    project frame (the library and C work it calls counted in), and the top leaves."""
    inclusive: Counter[str] = Counter()
    deepest: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f for f in stack.split(";") if f and not f.startswith("process ")]
        if not frames or not count.isdigit():
            continue
        n = int(count)
        total += n
        leaf[_short(frames[-1])] += n
        ours = [_short(f) for f in frames if _ours(f)]
        deepest[ours[-1] if ours else "(outside the project: start-up, event loop)"] += n
        for f in set(ours):
            inclusive[f] += n
    lines = ["| project function | inclusive % | as deepest project frame % |", "|---|---|---|"]
    for f, n in inclusive.most_common(top):
        lines.append(f"| `{f}` | {100 * n / total:.1f} | {100 * deepest[f] / total:.1f} |")
    lines += ["", "| deepest project frame | % |", "|---|---|"]
    lines += [f"| `{f}` | {100 * n / total:.1f} |" for f, n in deepest.most_common(top)]
    lines += ["", "| leaf function | % |", "|---|---|"]
    lines += [f"| `{f}` | {100 * n / total:.1f} |" for f, n in leaf.most_common(top)]
    return lines + ["", f"({total} samples at 250 Hz with the GIL held)"]


def _ours(frame: str) -> bool:
    where = frame.partition(" (")[2]
    return where.startswith(PROJECT) and not where.startswith(LAUNCHER)


def _short(frame: str) -> str:
    """``func (path/to/mod.py:12)`` -> ``func (to/mod.py)``: one row per function."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({path})"
