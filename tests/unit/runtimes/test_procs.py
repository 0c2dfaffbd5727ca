"""Finding and killing process trees by their environment tags."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time

from services.runtimes.procs import environ_has, kill_tree, tagged_pids
from tests.unit.runtimes.support import alive


def test_environ_has_matches_whole_entries_only():
    environ = b"A=1\0POLAR_EXEC_ID=abc\0B=2\0"
    assert environ_has(environ, "POLAR_EXEC_ID", "abc")
    assert not environ_has(environ, "POLAR_EXEC_ID", "ab")
    assert not environ_has(b"XPOLAR_EXEC_ID=abc\0", "POLAR_EXEC_ID", "abc")


def _start(tag_value: str, script: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "POLAR_EXEC_ID": tag_value}
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == b"go\n"
    return proc


async def test_kill_tree_finds_a_setsid_grandchild_outside_the_group():
    proc = _start("t-procs-1", "setsid sleep 1000 & sleep 1000 & echo go; wait")
    try:
        # exactly 3 in two groups, once setsid has run (its own fork shows a 4th for a
        # moment, and for a moment before it calls setsid() it is still in the group)
        def seen() -> tuple[list[int], set[int]]:
            found, groups = [], set()
            for pid in tagged_pids("POLAR_EXEC_ID", "t-procs-1"):
                with contextlib.suppress(ProcessLookupError):  # setsid's fork, gone
                    groups.add(os.getpgid(pid))
                    found.append(pid)
            return found, groups

        deadline = time.monotonic() + 5
        pids, groups = seen()
        while (len(pids), len(groups)) != (3, 2) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            pids, groups = seen()
        assert len(pids) == 3  # sh, sleep, setsid'd sleep
        assert len(groups) == 2  # one of them left the process group
    finally:  # a failed check must not leave sleeps behind for the next run to count
        left = await kill_tree(proc.pid, ("POLAR_EXEC_ID", "t-procs-1"), grace=0.5)
        proc.wait(timeout=5)
    assert left == []
    assert not [p for p in pids if alive(p)]
    assert tagged_pids("POLAR_EXEC_ID", "t-procs-1") == []


async def test_kill_tree_escalates_to_sigkill_after_grace():
    proc = _start("t-procs-2", "trap '' TERM; echo go; sleep 1000")
    started = time.monotonic()
    assert await kill_tree(proc.pid, ("POLAR_EXEC_ID", "t-procs-2"), grace=0.3) == []
    assert proc.wait(timeout=5) == -9
    assert 0.3 <= time.monotonic() - started < 3


async def test_kill_tree_with_nothing_to_kill_is_a_no_op():
    assert await kill_tree(None, ("POLAR_EXEC_ID", "nobody-has-this"), grace=0.5) == []


def _sleeper(env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "1000"], env={**os.environ, **(env or {})})


def test_a_scan_remembers_settled_untagged_processes_and_forgets_exited_ones(monkeypatch):
    """An untagged process that started before the scan's settle window is pinned and
    not read again; once it exits its pidfd says so and it is forgotten (its pid may be
    reused by a tagged process, which must then be read)."""
    from services.runtimes import procs

    known = procs._Untagged(limit=1024)
    monkeypatch.setattr(procs, "_UNTAGGED", known)
    monkeypatch.setattr(procs, "_SETTLED_SECONDS", 0.0)
    plain = _sleeper()
    try:
        time.sleep(0.05)  # start times count in clock ticks
        assert tagged_pids("POLAR_EXEC_ID", "t-procs-3") == []
        assert plain.pid in known.fds
        reads: list[str] = []
        read = procs._read_environ
        monkeypatch.setattr(procs, "_read_environ", lambda p: reads.append(p) or read(p))
        tagged = _sleeper({"POLAR_EXEC_ID": "t-procs-3"})
        assert tagged_pids("POLAR_EXEC_ID", "t-procs-3") == [tagged.pid]
        assert f"/proc/{plain.pid}/environ" not in reads  # remembered: not read again
        assert tagged.pid not in known.fds  # a tagged process is never remembered
        plain.kill()
        plain.wait()
        tagged_pids("POLAR_EXEC_ID", "t-procs-3")
        assert plain.pid not in known.fds and len(known.fds) == len(known._pids)
    finally:
        for p in (plain, *([tagged] if "tagged" in locals() else [])):
            p.kill()
            p.wait()
        known.clear()


def test_a_scan_does_not_remember_a_process_younger_than_the_settle_window(monkeypatch):
    """A process just forked may still be on its way to exec with a tag: it is read on
    every scan until it is older than the window."""
    from services.runtimes import procs

    known = procs._Untagged(limit=1024)
    monkeypatch.setattr(procs, "_UNTAGGED", known)
    young = _sleeper()
    try:
        assert tagged_pids("POLAR_RUNTIME_ID", "t-procs-4") == []
        assert young.pid not in known.fds
        assert known.fds  # older processes (this test's own parents) are remembered
    finally:
        young.kill()
        young.wait()
        known.clear()


def test_the_remembered_set_is_bounded(monkeypatch):
    from services.runtimes import procs

    known = procs._Untagged(limit=3)
    monkeypatch.setattr(procs, "_UNTAGGED", known)
    monkeypatch.setattr(procs, "_SETTLED_SECONDS", 0.0)
    try:
        tagged_pids("POLAR_SESSION_ID", "t-procs-5")
        assert len(known.fds) == 3
    finally:
        known.clear()


def test_a_scan_for_another_name_neither_uses_nor_fills_the_remembered_set(monkeypatch):
    from services.runtimes import procs

    known = procs._Untagged(limit=1024)
    monkeypatch.setattr(procs, "_UNTAGGED", known)
    monkeypatch.setattr(procs, "_SETTLED_SECONDS", 0.0)
    other = _sleeper({"OTHER_TAG": "t-procs-6"})
    try:
        time.sleep(0.05)
        tagged_pids("POLAR_EXEC_ID", "t-procs-6")
        assert other.pid in known.fds  # untagged by every runtime tag: remembered
        assert tagged_pids("OTHER_TAG", "t-procs-6") == [other.pid]  # still found
    finally:
        other.kill()
        other.wait()
        known.clear()
