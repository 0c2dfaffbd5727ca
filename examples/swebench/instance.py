"""The example's offline SWE-bench instance, built from the tiny repository in
``textstats/``: committed with git (fixed author and dates, so ``base_commit`` is the same
on every machine), the gold patch and the test patch made by git against it, and the
instance image (the repository at ``/testbed`` on top of ``polar-swebench:latest``, which
``build_image.sh`` makes from Debian packages) built with podman, offline.

    python -m examples.swebench.instance --out instance.json [--build]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from evaluators.swebench_tasks import eval_script_for

HERE = Path(__file__).resolve().parent
SNAPSHOT = HERE / "textstats"
INSTANCE_ID = "polar__textstats-1"
BASE_IMAGE = os.environ.get("POLAR_SWEBENCH_IMAGE", "polar-swebench:latest")
IMAGE = "polar-swebench-textstats:latest"
TEST_CMD = "python3 -m pytest -rA -p no:cacheprovider"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "polar",
    "GIT_AUTHOR_EMAIL": "polar@localhost",
    "GIT_COMMITTER_NAME": "polar",
    "GIT_COMMITTER_EMAIL": "polar@localhost",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
}
PROBLEM = """count_words() miscounts when words are separated by more than one space

`count_words("a  b ")` returns 4 and `count_words("")` returns 1. Runs of whitespace
(several spaces, tabs, newlines, leading or trailing ones) should separate words, and a
text without words has none.
"""
# the gold fix, and a plausible wrong one (strips the ends, still splits on one space)
GOLD = ('return len(text.split(" "))', "return len(text.split())")
WRONG = ('return len(text.split(" "))', 'return len(text.strip().split(" "))')
NEW_TESTS = """

def test_count_extra_spaces():
    assert count_words("a  b ") == 2


def test_count_empty():
    assert count_words("") == 0
"""
WORDS = "textstats/words.py"
TESTS = "tests/test_words.py"


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(
        ["git", "-c", "core.hooksPath=/dev/null", *args],
        cwd=repo, env=env, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


def _diff_of(repo: Path, path: str, text: str) -> str:
    """The diff that turns ``path`` into ``text`` against HEAD (the tree left as it was)."""
    original = (repo / path).read_text()
    (repo / path).write_text(text)
    try:
        return _git(repo, "diff", "HEAD", "--", path)
    finally:
        (repo / path).write_text(original)


def commit_snapshot(dest: Path) -> str:
    """``textstats/`` as a git repository at ``dest``; returns the base commit."""
    shutil.copytree(SNAPSHOT, dest)
    _git(dest, "init", "-q", "-b", "main")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", "textstats 0.1")
    return _git(dest, "rev-parse", "HEAD").strip()


def patch_of(repo: Path, change: tuple[str, str]) -> str:
    source = (repo / WORDS).read_text()
    assert change[0] in source, change
    return _diff_of(repo, WORDS, source.replace(*change))


def make_instance(repo: Path) -> dict:
    """The instance, SWE-bench's fields first, then the swebench >= 5 grading fields."""
    base = commit_snapshot(repo)
    tests = (repo / TESTS).read_text()
    instance = {
        "repo": "polar/textstats",
        "instance_id": INSTANCE_ID,
        "base_commit": base,
        "patch": patch_of(repo, GOLD),
        "test_patch": _diff_of(repo, TESTS, tests + NEW_TESTS),
        "problem_statement": PROBLEM,
        "hints_text": "",
        "created_at": "2026-01-01T00:00:00Z",
        "version": "0.1",
        "FAIL_TO_PASS": [f"{TESTS}::test_count_extra_spaces", f"{TESTS}::test_count_empty"],
        "PASS_TO_PASS": [f"{TESTS}::test_count_simple", f"{TESTS}::test_longest"],
        "environment_setup_commit": base,
        "image": IMAGE,
        "log_parser": "parse_log_pytest",
        "eval_type": "pass_and_fail",
    }
    instance["eval_script"] = eval_script_for(instance, TEST_CMD)
    return instance


def wrong_patch(repo: Path) -> str:
    return patch_of(repo, WRONG)


def build_image(repo: Path, engine: str = "podman") -> str:
    """The instance image: the committed repository at /testbed (no registry needed:
    the base image is local)."""
    containerfile = f"FROM {BASE_IMAGE}\nCOPY . /testbed\nWORKDIR /testbed\n"
    (repo / ".containerignore").write_text("")
    with tempfile.NamedTemporaryFile("w", suffix=".Containerfile", delete=False) as f:
        f.write(containerfile)
    try:
        subprocess.run(
            [engine, "build", "--pull=never", "-q", "-t", IMAGE, "-f", f.name, str(repo)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
    finally:
        os.unlink(f.name)
        (repo / ".containerignore").unlink()
    return IMAGE


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="instance .json (default: stdout)")
    p.add_argument("--build", action="store_true", help="build the instance image too")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="polar-textstats-") as tmp:
        repo = Path(tmp) / "textstats"
        instance = make_instance(repo)
        if args.build:
            print(f"built {build_image(repo)}", file=sys.stderr)
    text = json.dumps(instance, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
