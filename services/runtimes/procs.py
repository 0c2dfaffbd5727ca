"""Finding and killing a process tree on this host, even parts that left its process group.

Every process a runtime starts carries tag variables in its environment
(`POLAR_RUNTIME_ID`, `POLAR_EXEC_ID`). A child that calls `setsid` leaves the process
group but keeps its environment, so a scan of `/proc/*/environ` still finds it.
Zombies have an empty environ and are skipped: they hold no resources but a pid.

Most of a node's processes (services, servers, shells) carry no tag and live long, so a
scan remembers them (`_Untagged`) and reads only the environ of the others: the ~1 ms
of reading every process on every runtime stop becomes a listing and one `poll`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path

TAG_SESSION = "POLAR_SESSION_ID"
TAG_RUNTIME = "POLAR_RUNTIME_ID"
TAG_EXEC = "POLAR_EXEC_ID"

TAGS = (TAG_SESSION, TAG_RUNTIME, TAG_EXEC)

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
    known = _UNTAGGED if proc_root == PROC_ROOT and name in TAGS else None
    with _SCAN_LOCK:
        uptime = _uptime() if known is not None else 0.0  # before the listing: see remember
        # Plain os calls, not pathlib: this scan runs on every kill and stop (hot path).
        entries = os.listdir(proc_root)
        if known is not None:
            known.prune()  # after the listing: a pid still pinned now was the one listed
        for entry in entries:
            if not entry.isdigit():
                continue
            pid = int(entry)
            if pid == me or (known is not None and pid in known.fds):
                continue
            environ = _read_environ(f"{proc_root}/{entry}/environ")
            if needle in environ and environ_has(environ, name, value):
                found.append(pid)
            elif known is not None and not any(t in environ for t in _TAG_BYTES):
                known.remember(pid, uptime)
    return found


_TAG_BYTES = tuple(f"{t}=".encode() for t in TAGS)
_SETTLED_SECONDS = 5.0  # how old a process must be for the scan to remember it untagged
_CLK_TCK = os.sysconf("SC_CLK_TCK")


class _Untagged:
    """Processes a scan found carrying no tag, each pinned by a pidfd, so a later scan
    skips them without reading their environ.

    Sound because a process keeps its environ until it execs, and a process that will
    carry a tag gets it when its creator execs it (fork + exec, microseconds apart): one
    remembered only when it started more than ``_SETTLED_SECONDS`` before the scan began
    was not such a process between its fork and its exec. The pidfd makes pid reuse
    visible: once the process exits its pidfd polls readable and ``prune`` forgets it,
    so a new process given the same pid is read like any other. A process that deliberately
    execs itself into a runtime's tag long after it started (``exec env POLAR_...=``) is
    not found; none of the runtimes start processes that way.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.fds: dict[int, int] = {}  # pid -> pidfd
        self._pids: dict[int, int] = {}  # pidfd -> pid
        self._poll = select.poll()

    def prune(self) -> None:
        """Forget every remembered process that has exited since it was remembered."""
        for fd, _ in self._poll.poll(0):
            self._forget(self._pids[fd])

    def remember(self, pid: int, uptime: float) -> None:
        """Pin ``pid`` if it started ``_SETTLED_SECONDS`` before ``uptime`` (the boot
        clock at the start of the scan that read it untagged). Its pidfd is taken before
        its start time is read: the pinned process is then the one that was read, since
        it already existed then."""
        if len(self.fds) >= self.limit:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already, or no pidfds here: it is read next time
            return
        started = _start_seconds(pid)
        if started is None or started >= uptime - _SETTLED_SECONDS:
            os.close(fd)
            return
        self.fds[pid], self._pids[fd] = fd, pid
        self._poll.register(fd, select.POLLIN)

    def _forget(self, pid: int) -> None:
        fd = self.fds.pop(pid)
        del self._pids[fd]
        self._poll.unregister(fd)
        os.close(fd)

    def clear(self) -> None:
        for pid in list(self.fds):
            self._forget(pid)


def _fd_budget() -> int:
    """At most a quarter of this process's file descriptors, and 1,024, are pinned."""
    with contextlib.suppress(ValueError, OSError):
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft > 0:
            return min(1024, soft // 4)
    return 256


_UNTAGGED = _Untagged(_fd_budget())
_SCAN_LOCK = threading.Lock()  # scans may run in threads (tests, to_thread callers)


def _uptime() -> float:
    """Seconds since boot, the clock `/proc/<pid>/stat` start times are counted on (the
    one `/proc/uptime` shows; read through the vDSO, not a file)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _start_seconds(pid: int) -> float | None:
    """When ``pid`` started, in seconds since boot; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # Field 22, counted after the command name (which may hold spaces and parens).
        return int(stat.rsplit(b")", 1)[1].split()[19]) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


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
