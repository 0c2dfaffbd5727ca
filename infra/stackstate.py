"""The dev stack's record of what it started (``<state_dir>/stack.json``) and the
process facts ``polar down`` relies on.

Every process the stack starts leads its own process group (``start_new_session``), so
stopping the group stops its children too. Each record keeps the process's start time
from ``/proc``: a pid the kernel has since given to another process is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import msgspec

STATE_FILE = "stack.json"


class Proc(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # nats | redis | a service instance
    pid: int | None  # None: reused, not started by us
    start_ticks: int | None  # /proc/<pid>/stat starttime: tells a reused pid apart
    url: str
    port: int
    started: bool  # False: was already running; ``down`` leaves it alone
    log: str | None = None


class StackState(msgspec.Struct, kw_only=True):
    version: int = 1
    state_dir: str
    created_at: float
    procs: list[Proc] = []

    def started(self) -> list[Proc]:
        return [p for p in self.procs if p.started and p.pid is not None]

    def get(self, name: str) -> Proc | None:
        return next((p for p in self.procs if p.name == name), None)


def state_path(state_dir: Path) -> Path:
    return Path(state_dir) / STATE_FILE


def read_state(state_dir: Path) -> StackState | None:
    path = state_path(state_dir)
    try:
        return msgspec.json.decode(path.read_bytes(), type=StackState)
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, OSError) as exc:
        raise RuntimeError(f"unreadable stack state {path}: {exc}; remove it by hand") from None


def write_state(state: StackState) -> None:
    """Atomically replace the state file (a crash never leaves half a record)."""
    path = state_path(Path(state.state_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state)))
    os.replace(tmp, path)


def remove_state(state_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        state_path(state_dir).unlink()


# -- processes (Linux /proc) ----------------------------------------------------------
def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (index 0 is the state)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22 of stat(5)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def alive(pid: int, ticks: int | None = None) -> bool:
    """``pid`` runs (not a zombie) and, when ``ticks`` is given, is the same process."""
    _reap(pid)
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return ticks is None or int(fields[19]) == ticks


def proc_alive(p: Proc) -> bool:
    return p.pid is not None and alive(p.pid, p.start_ticks)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:  # not our group after all: signal the leader only
        with contextlib.suppress(ProcessLookupError):
            os.kill(pgid, sig)


def _wait_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if not group_members(pgid):
            _reap(pgid)  # the leader may be a zombie of ours: collect it
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def stop_group(p: Proc, timeout: float = 10.0) -> bool:
    """SIGTERM the process group ``p`` leads, then SIGKILL what is left. Returns False,
    signalling nothing, when nothing of it runs or its pid now belongs to another process."""
    if p.pid is None:
        return False
    fields = _stat_fields(p.pid)
    if fields is not None and p.start_ticks is not None and int(fields[19]) != p.start_ticks:
        return False  # the pid was reused: not ours
    leader_runs = fields is not None and fields[0] not in ("Z", "X")
    # A group id is not reused while the group has members: leftovers are ours.
    if not leader_runs and not group_members(p.pid):
        return False
    _signal_group(p.pid, signal.SIGTERM)
    if not _wait_gone(p.pid, timeout):
        _signal_group(p.pid, signal.SIGKILL)
        _wait_gone(p.pid, timeout)
    return True


def split_alive(state: StackState) -> tuple[list[Proc], list[Proc]]:
    """(alive, dead) among the processes the stack started."""
    started = state.started()
    up = [p for p in started if proc_alive(p)]
    return up, [p for p in started if p not in up]
