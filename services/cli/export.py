"""The ``export`` command (``polar export``): trajectories to SFT or slime files."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Literal

import typer

from infra.topology import TopologyError
from services.cli.connect import open_bus
from services.cli.context import Stack, StateDirOpt, TopologyOpt, Unreachable
from services.export.export import ExportStats, export
from services.export.writers import ExportError


async def _run(nats_url: str, out: Path, **kw) -> ExportStats:
    try:
        bus = await open_bus(nats_url, "polar-export")  # fails fast when NATS is not there
    except Unreachable as exc:
        raise ExportError(str(exc)) from None
    try:
        return await export(bus, out, **kw)
    finally:
        await bus.close()


def export_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="file to write")],
    layout: Annotated[
        Literal["sft", "slime"], typer.Option(help="sft: passed sessions; slime: samples")
    ] = "sft",
    fmt: Annotated[
        Literal["jsonl", "parquet"], typer.Option("--format", help="file format")
    ] = "jsonl",
    task: Annotated[str | None, typer.Option("--task", help="one task id (default: all)")] = None,
    min_reward: Annotated[
        float | None, typer.Option(help="keep sessions with reward >= this (sft default 1.0)")
    ] = None,
    regrade: Annotated[
        str | None,
        typer.Option(help="a re-grade's trajectories and rewards (`polar regrade` names it)"),
    ] = None,
    nats_url: Annotated[
        str | None,
        typer.Option(envvar="POLAR_NATS_URL", help="NATS URL (default: the topology's)"),
    ] = None,
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Export stored trajectories: an SFT corpus or Slime samples, as JSONL or Parquet."""
    try:
        if nats_url is None:  # like every other command: the running stack's, else the topology's
            nats_url = Stack.load(topology, state_dir).nats_url
        stats = asyncio.run(
            _run(
                nats_url,
                out,
                layout=layout,
                fmt=fmt,
                task_id=task,
                min_reward=min_reward,
                regrade=regrade,
            )
        )
    except (ExportError, TopologyError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"{stats.rows} rows from {stats.exported} of {stats.trajectories} trajectories -> {out}"
    )
    for problem in stats.unreadable:
        typer.echo(f"unreadable: {problem}", err=True)
