"""Helpers for runtime tests: process liveness, the forking harness, leftovers."""

from __future__ import annotations

import socket
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
