"""Other checkouts of this repository for A/B benchmarks: a detached ``git worktree`` of
a commit, and a one-line label of what a tree holds."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def baseline_tree(ref: str, work: Path, name: str = "baseline") -> Iterator[Path]:
    """A detached worktree of ``ref`` at ``work / name`` (removed after)."""
    path = work / name
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref],
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
            capture_output=True,
        )


def commit_of(tree: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(tree), "log", "-1", "--format=%h %s"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return out.stdout.strip()[:70] + (" (+ uncommitted changes)" if dirty else "")
