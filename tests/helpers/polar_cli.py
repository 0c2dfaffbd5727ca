"""The `polar` command run as a user runs it, from this checkout, in a fresh process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_polar(
    *args: str, timeout: float, columns: int = 400, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``polar ARGS``: none of the test process's own ``POLAR_*`` variables (a stack's
    credentials are its own), output wide enough for one line per table row. ``polar up``
    writes no ``nats`` CLI context (it would replace the developer's own ``polar`` one)
    unless ``env`` names one; ``env`` is set over the rest."""
    own = {k: v for k, v in os.environ.items() if not k.startswith("POLAR_")}
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        cwd=ROOT,
        env={
            **own,
            "COLUMNS": str(columns),
            "NO_PROXY": "127.0.0.1,localhost",
            "POLAR_NATS_CONTEXT": "",
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def demo_stack_up(prefix: str) -> Iterator[tuple[Any, Path, subprocess.CompletedProcess[str]]]:
    """The demo's stack started by `polar up` in a fresh state dir: (topology, its file,
    what `up` printed); stopped, and the file removed, at the end."""
    from infra import devstack
    from infra.topology import parse_topology
    from services.cli.demo import demo_topology

    state_dir = Path(tempfile.mkdtemp(prefix=prefix))
    topology = state_dir.parent / f"{state_dir.name}.yaml"
    topology.write_text(demo_topology(state_dir))
    topo = parse_topology(topology.read_text(), f"{prefix} topology")
    up = run_polar("up", "--topology", str(topology), timeout=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield topo, topology, up
    finally:
        devstack.down(state_dir)
        topology.unlink()
