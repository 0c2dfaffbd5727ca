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
    needle = f"{name}={value}".encode()
    found = []
    # Plain os calls, not pathlib: this scan runs on every kill and stop (hot path).
    for entry in os.listdir(proc_root):
        if not entry.isdigit() or int(entry) == me:
            continue
        environ = _read_environ(f"{proc_root}/{entry}/environ")
        if needle in environ and environ_has(environ, name, value):
            found.append(int(entry))
    return found


def _read_environ(path: str) -> bytes:
    """The environ block; empty if the process is gone or not ours to read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return b""
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return b""
    finally:
        os.close(fd)


def signal_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_groups(pgids: Iterable[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


async def kill_tree(pgid: int | None, tag: tuple[str, str], grace: float) -> list[int]:
    """``kill_trees`` of one group (or of the tagged processes alone: ``pgid`` None)."""
    return await kill_trees(() if pgid is None else (pgid,), tag, grace)


async def kill_trees(pgids: Iterable[int], tag: tuple[str, str], grace: float) -> list[int]:
    """SIGTERM the groups and every tagged process, wait up to `grace`, then SIGKILL
    (at once when `grace` is 0).

    A scan that finds no tagged process ends it: only a tagged process could start
    another one (the tag is inherited), so when everything has exited already, the
    common case, it costs one scan of /proc. Returns the pids still found alive after
    the kill sweeps (normally none).
    """
    name, value = tag
    pgids = tuple(pgids)
    if grace > 0:
        signal_groups(pgids, signal.SIGTERM)
        pids = tagged_pids(name, value)
        signal_pids(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:  # nothing found: nothing to wait for
            await asyncio.sleep(_POLL_SECONDS)
            pids = tagged_pids(name, value)
        if not pids:
            signal_groups(pgids, signal.SIGKILL)  # an untagged member (env -i) included
            return []
    signal_groups(pgids, signal.SIGKILL)
    # A process may fork between a scan and a kill: sweep until nothing is left.
    deadline = time.monotonic() + _KILL_SWEEP_SECONDS
    while (left := tagged_pids(name, value)) and time.monotonic() < deadline:
        signal_pids(left, signal.SIGKILL)
        await asyncio.sleep(_POLL_SECONDS)
    return left
