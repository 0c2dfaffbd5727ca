"""Helpers for runtime tests: process liveness, the forking harness, leftovers."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

from services.runtimes.procs import TAG_RUNTIME, tagged_pids

# Forks a child, a `setsid` grandchild (leaves the process group) and a child that
# ignores SIGTERM; records their pids (as seen where it runs), then sleeps.
FORKING_HARNESS = r"""
sleep 1000 &
echo $! >> pids
setsid sh -c 'echo $$ >> pids; exec sleep 1001' &
sh -c 'trap "" TERM; echo $$ >> pids; exec sleep 1002' &
while [ "$(wc -l < pids)" -lt 3 ]; do sleep 0.01; done
echo forked
sleep 1000
"""


def alive(pid: int) -> bool:
    """A process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def leftovers(runtime_id: str) -> list[int]:
    return tagged_pids(TAG_RUNTIME, runtime_id)


async def settled_leftovers(runtime_id: str, expect: int, timeout: float = 60.0) -> list[int]:
    """``leftovers`` once there are ``expect`` of them, or at the timeout: a shell's
    ``&`` and setsid's own fork take a moment to leave one process behind."""
    deadline = time.monotonic() + timeout
    while len(pids := leftovers(runtime_id)) != expect and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return pids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
