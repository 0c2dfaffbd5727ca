"""A tiny calculator repository with a bug, the diff that fixes it (made with git, as the
executor makes it), and how to test it; shared by evaluator unit and integration tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
FIXED = BUGGY.replace("return a - b", "return a + b")
TESTS = """from calc import add, mul


def test_add():
    assert add(2, 3) == 5


def test_add_zero():
    assert add(0, 0) == 0


def test_mul():
    assert mul(2, 3) == 6
"""
NOTES = "fixed add\n"  # a new file in the diff: untracked files travel too

# Plugins off: the venv's pytest plugins cost seconds at startup and add nothing here.
TEST_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
TEST_COMMAND = [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_calc.py"]
EXPECTED_FIXED = {
    "test_calc.py::test_add": "PASSED",
    "test_calc.py::test_add_zero": "PASSED",
    "test_calc.py::test_mul": "PASSED",
}
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "core.hooksPath=/dev/null"]


def write_repo(dest: Path, calc: str = BUGGY) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "calc.py").write_text(calc)
    (dest / "test_calc.py").write_text(TESTS)
    (dest / "pytest.ini").write_text("[pytest]\n")
    return dest


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def fix_diff(work: Path) -> str:
    """The agent's diff: baseline commit, fix, ``git add -A; git diff --cached HEAD``."""
    repo = write_repo(work / "agent-repo")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "baseline")
    (repo / "calc.py").write_text(FIXED)
    (repo / "NOTES.md").write_text(NOTES)
    _git(repo, "add", "-A")
    diff = _git(repo, "diff", "--cached", "--binary", "HEAD")
    shutil.rmtree(repo)
    return diff


MORE_TESTS = "from calc import mul\n\n\ndef test_mul_zero():\n    assert mul(5, 0) == 0\n"


def swebench_instance(python: str = sys.executable) -> dict:
    """A SWE-bench-shaped instance for the calculator: the eval script adds a test file
    (the "test patch"), runs pytest between the markers, and the gold lists say which
    tests must go from failing to passing and which must keep passing."""
    script = "\n".join(
        [
            "#!/bin/bash",
            "set -uxo pipefail",
            "cat > test_more.py <<'EOF_114329324912'",
            MORE_TESTS.rstrip("\n"),
            "EOF_114329324912",
            ": '>>>>> Start Test Output'",
            f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {python} -m pytest -rA -p no:cacheprovider"
            " test_calc.py test_more.py",
            ": '>>>>> End Test Output'",
            "rm -f test_more.py",
        ]
    )
    return {
        "instance_id": "calc__calc-1",
        "repo": "polar/calc",
        "version": "0.1",
        "FAIL_TO_PASS": ["test_calc.py::test_add"],
        "PASS_TO_PASS": ["test_calc.py::test_mul", "test_more.py::test_mul_zero"],
        "eval_script": script,
        "log_parser": "parse_log_pytest",
        "eval_type": "pass_and_fail",
    }
