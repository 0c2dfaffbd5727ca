"""Rich output for the CLI: tables for the stack, status and results; the live progress."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from infra.devstack import DownReport
from infra.stackstate import StackState
from schemas import TaskResult
from services.cli import taskfile
from services.common.redact import redact

if TYPE_CHECKING:
    from services.cli.status import StatusReport

STATE_STYLE = {"COMPLETED": "green", "ERROR": "red", "TIMEOUT": "yellow", "CANCELLED": "magenta"}


def stack_table(state: StackState, alive: dict[str, bool]) -> Table:
    t = Table(title=f"Polar dev stack (logs and data in {state.state_dir})")
    for col in ("component", "listens on", "pid", ""):
        t.add_column(col, no_wrap=True)
    t.add_column("log")
    for p in state.procs:
        origin = "started" if p.started else "reused"
        if p.started and not alive.get(p.name, False):
            origin = "[red]exited[/red]"
        t.add_row(p.name, p.url, str(p.pid or "-"), origin, _relative(p.log, state.state_dir))
    return t


def _relative(path: str | None, base: str) -> str:
    if not path:
        return "-"
    return str(Path(path).relative_to(base)) if Path(path).is_relative_to(base) else path


def down_lines(report: DownReport) -> list[str]:
    lines = [f"stopped: {', '.join(report.stopped)}"] if report.stopped else []
    if report.already_gone:
        lines.append(f"already gone: {', '.join(report.already_gone)}")
    if report.left_running:
        lines.append(f"left running (not started by polar up): {', '.join(report.left_running)}")
    if report.still_listening:
        ports = ", ".join(map(str, report.still_listening))
        lines.append(f"[red]still listening after stop: port(s) {ports}[/red]")
    return lines or ["no stack was running"]


def _health_cell(status: int | None, detail: object) -> str:
    if status == 200:
        return "[green]healthy[/green]"
    if status is None:
        return f"[red]down[/red] ({detail})"
    checks = detail.get("checks") if isinstance(detail, dict) else detail
    return f"[red]unhealthy {status}[/red] {checks}"


def services_table(report: StatusReport) -> Table:
    t = Table(title="services")
    for col in ("service", "url", "pid"):
        t.add_column(col, no_wrap=True)
    t.add_column("health")
    for s in report.services:
        t.add_row(s.name, s.url, str(s.pid or "-"), _health_cell(s.status, s.detail))
    return t


def nodes_table(report: StatusReport) -> Table | str:
    if not report.nodes:
        return "nodes: none has sent a heartbeat" if report.nodes is not None else ""
    t = Table(title="nodes")
    for col in ("node", "service", "last heartbeat", "stages (in use / bound)"):
        t.add_column(col)
    for n in report.nodes:
        age = "?" if n.age_seconds is None else f"{n.age_seconds:.1f}s ago"
        t.add_row(n.node, n.service, age, stage_usage(n.stages, n.capacity))
    return t


def stage_usage(stages: dict[str, int], capacity: dict[str, int]) -> str:
    """``INIT 3/4  READY 2/4  RUNNING 5/8``: a stage with a bound shows it."""
    parts = [f"{k} {v}/{capacity[k]}" if k in capacity else f"{k} {v}" for k, v in stages.items()]
    return "  ".join(parts) or "-"


def _kv(d: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items()) or "-"


def streams_table(report: StatusReport) -> Table | str:
    if report.streams is None:
        return ""
    t = Table(title="stream backlogs")
    t.add_column("stream", no_wrap=True)
    t.add_column("msgs", justify="right")
    t.add_column("consumer", no_wrap=True)
    for col in ("pending", "unacked", "redeliv"):
        t.add_column(col, justify="right")
    for s in report.streams:
        msgs = "not created" if s.messages is None else str(s.messages)
        if not s.consumers:
            t.add_row(s.name, msgs, "-", "", "", "")
        for i, c in enumerate(s.consumers):
            t.add_row(
                s.name if i == 0 else "",
                msgs if i == 0 else "",
                c.name,
                str(c.pending),
                str(c.ack_pending),
                str(c.redelivered),
            )
    return t


def sessions_table(counts: dict[str, int] | None, title: str = "sessions by state") -> Table | str:
    if counts is None:
        return ""
    if not counts:
        return f"{title}: none"
    t = Table(title=title)
    t.add_column("state")
    t.add_column("sessions", justify="right")
    for state, n in taskfile.ordered_counts(counts):
        style = STATE_STYLE.get(state, "")
        t.add_row(f"[{style}]{state}[/{style}]" if style else state, str(n))
    return t


def tasks_table(report: StatusReport, now: float) -> Table | str:
    if report.tasks is None:
        return ""
    if not report.tasks:
        return "tasks: none"
    more = f", {report.tasks_not_shown} more active" if report.tasks_not_shown else ""
    t = Table(title=f"tasks (active, then the latest finished{more})")
    for col in ("task", "status", "submitted", "sessions by state"):
        t.add_column(col, no_wrap=col != "sessions by state")
    for row in report.tasks:
        age = max(0.0, now - row.submitted_at)
        ago = f"{age:.0f}s ago" if age < 120 else f"{age / 60:.0f}m ago"
        counts = " ".join(f"{k}={v}" for k, v in taskfile.ordered_counts(row.counts)) or "-"
        t.add_row(row.task_id, row.status, ago, counts)
    return t


def print_status(console: Console, report: StatusReport) -> None:
    console.print(f"NATS {redact(report.nats_url)}   Redis {redact(report.redis_url)}")
    console.print(f"stack record: {report.stack_record or 'none (not started by polar up)'}")
    for part in (
        services_table(report),
        nodes_table(report),
        streams_table(report),
        sessions_table(report.sessions),
        tasks_table(report, time.time()),
    ):
        if part != "":
            console.print(part)
    for err in report.errors:
        console.print(f"[red]{err}[/red]")


def results_table(result: TaskResult) -> Table:
    mean = "-" if result.mean_reward is None else f"{result.mean_reward:.4g}"
    t = Table(title=f"task {result.task_id}: {result.status}, mean reward {mean}")
    for col in ("session", "state", "reward", "reason", "evaluator"):
        t.add_column(col)
    for s in result.sessions:
        style = STATE_STYLE.get(s.state, "")
        state = f"[{style}]{s.state}[/{style}]" if style else s.state
        reward = "-" if s.reward is None else f"{s.reward:.4g}"
        t.add_row(s.session_id, state, reward, s.reason or "", s.eval_reason or "")
    return t


class SessionProgress:
    """A live view while a task runs: sessions finished out of all, and a bar per state."""

    def __init__(self, console: Console, total: int, task_id: str) -> None:
        self.total = max(total, 1)
        cols = (TextColumn("{task.description:>14}"), BarColumn(), MofNCompleteColumn())
        self.overall = Progress(*cols, TimeElapsedColumn(), console=console)
        self.by_state = Progress(*cols, console=console)
        self.done = self.overall.add_task(f"{task_id[:14]}", total=self.total)
        # one bar per state, in lifecycle order, shown once a session reaches it
        self.bars = {
            state: self.by_state.add_task(state, total=self.total, visible=False)
            for state in taskfile.STATE_ORDER
        }
        self.seen: set[str] = set()
        self.live = Live(Group(self.overall, self.by_state), console=console, refresh_per_second=8)

    def __enter__(self) -> SessionProgress:
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)
        if not self.live.console.is_terminal:  # the last frame ends without a newline
            self.live.console.line()

    def update(self, counts: dict[str, int]) -> None:
        self.overall.update(self.done, completed=taskfile.finished(counts))
        for state, bar in self.bars.items():
            n = counts.get(state, 0)
            if n:
                self.seen.add(state)
            self.by_state.update(bar, completed=n, visible=state in self.seen)
