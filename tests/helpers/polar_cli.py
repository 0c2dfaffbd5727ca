"""The `polar` command run as a user runs it, from this checkout, in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_polar(*args: str, timeout: float, columns: int = 400) -> subprocess.CompletedProcess[str]:
    """``polar ARGS``: none of the test process's own ``POLAR_*`` variables (a stack's
    credentials are its own), output wide enough for one line per table row."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLAR_")}
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        cwd=ROOT,
        env={**env, "COLUMNS": str(columns), "NO_PROXY": "127.0.0.1,localhost"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
