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
