"""Processes of the benchmark: start pinned to a core, CPU seconds and RSS of a whole
process group (granian and uvicorn run their workers as child processes), stop."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from infra import localservers

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = _stat_fields(int(entry))
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: the process group
            pids.append(int(entry))
    return pids


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # fields from 3 (state) on


def cpu_seconds(pgid: int) -> float:
    """CPU seconds of every live process in the group (all threads, ended ones too), to
    the nanosecond: each process's own CPU clock. /proc's utime and stime count in
    10 ms ticks, about 3% of a proxy's cell, and every reading rounds."""
    total = 0.0
    for pid in group_pids(pgid):
        try:
            total += time.clock_gettime(_process_cpu_clock(pid))
        except OSError:  # gone since listed, or a kernel without such clocks
            try:
                fields = _stat_fields(pid)
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def _process_cpu_clock(pid: int) -> int:
    """clock_getcpuclockid(pid) as Linux encodes it: all the process's threads
    (CPUCLOCK_SCHED, 2, in the low bits; the pid complemented above them)."""
    return (~pid << 3) | 2


def cpu_split(pgid: int) -> tuple[float, float]:
    """(own, reaped children's) user + system CPU seconds of the group's live processes:
    a child counts in the second once its parent in the group has waited for it (a
    harness process the executor started and reaped)."""
    own = children = 0
    for pid in group_pids(pgid):
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        own += int(fields[11]) + int(fields[12])  # utime, stime
        children += int(fields[13]) + int(fields[14])  # cutime, cstime
    return own / CLK_TCK, children / CLK_TCK


def rss_bytes(pgid: int) -> int:
    total = 0
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except OSError:
            continue
    return total


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid`` (threads made later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def pin_group(pgid: int, cpus: set[int]) -> None:
    for pid in group_pids(pgid):
        pin(pid, cpus)


def spawn(
    argv: list[str], log: Path, cpus: set[int], env: dict | None = None, cwd: str | None = None
) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        )


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not up after {timeout}s: {log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        localservers.stop_process(proc.pid)
        proc.wait(10)
