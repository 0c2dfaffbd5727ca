"""Finding and killing a process tree on this host, even parts that left its process group.

Every process a runtime starts carries tag variables in its environment
(`POLAR_RUNTIME_ID`, `POLAR_EXEC_ID`). A child that calls `setsid` leaves the process
group but keeps its environment, so a scan of `/proc/*/environ` still finds it.
Zombies have an empty environ and are skipped: they hold no resources but a pid.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

TAG_SESSION = "POLAR_SESSION_ID"
TAG_RUNTIME = "POLAR_RUNTIME_ID"
TAG_EXEC = "POLAR_EXEC_ID"

PROC_ROOT = Path("/proc")
_POLL_SECONDS = 0.02
_KILL_SWEEP_SECONDS = 5.0


def environ_has(environ: bytes, name: str, value: str) -> bool:
    """Whether a NUL-separated environ block holds exactly `name=value`."""
    return f"{name}={value}".encode() in environ.split(b"\0")


def tagged_pids(name: str, value: str, proc_root: Path = PROC_ROOT) -> list[int]:
    """Live processes whose environment holds `name=value` (this process excluded)."""
    me = os.getpid()
    found = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if environ_has(environ, name, value):
            found.append(int(entry.name))
    return found


def signal_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_group(pgid: int | None, sig: int) -> None:
    if pgid is None:
        return
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def kill_tree(pgid: int | None, tag: tuple[str, str], grace: float) -> list[int]:
    """SIGTERM the group and every tagged process, wait up to `grace`, then SIGKILL
    (at once when `grace` is 0).

    Returns the pids still found alive after the kill sweeps (normally none).
    """
    name, value = tag
    if grace > 0:
        signal_group(pgid, signal.SIGTERM)
        signal_pids(tagged_pids(name, value), signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and tagged_pids(name, value):
            await asyncio.sleep(_POLL_SECONDS)
    signal_group(pgid, signal.SIGKILL)
    # A process may fork between a scan and a kill: sweep until nothing is left.
    deadline = time.monotonic() + _KILL_SWEEP_SECONDS
    while (left := tagged_pids(name, value)) and time.monotonic() < deadline:
        signal_pids(left, signal.SIGKILL)
        await asyncio.sleep(_POLL_SECONDS)
    return left
