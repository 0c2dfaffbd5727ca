"""Other checkouts of this repository for A/B benchmarks: a detached ``git worktree`` of
a commit, a one-line label of what a tree holds, and a worker script run on each tree's
code in turn."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
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


def run_worker(tree: Path, worker: str, cases: list) -> dict:
    """``worker`` (Python source: the JSON ``cases`` in argv[1], one JSON object printed)
    run on ``tree``'s code in a process of its own."""
    done = subprocess.run(
        [sys.executable, "-c", worker, json.dumps(cases)],
        cwd=str(tree),
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def alternated(
    worker: str, cases: list, rounds: int, baseline: str | None
) -> tuple[list[tuple[str, str]], dict[str, list[dict]]]:
    """``worker``'s results on this tree ("after") and, given ``baseline`` (a ref), on a
    worktree of it ("before"), rounds alternated so the machine's noise falls on both:
    [(label, what the tree holds)], and each label's results, one per round."""
    with tempfile.TemporaryDirectory() as work, contextlib.ExitStack() as stack:
        trees = [("after", ROOT)]
        if baseline:
            trees.insert(0, ("before", stack.enter_context(baseline_tree(baseline, Path(work)))))
        labels = [(label, commit_of(tree)) for label, tree in trees]
        runs: dict[str, list[dict]] = {label: [] for label, _ in trees}
        for i in range(rounds):
            for label, tree in trees[i % len(trees) :] + trees[: i % len(trees)]:
                runs[label].append(run_worker(tree, worker, cases))
    return labels, runs
