"""Per-test results from a test runner's output, and how they compare to expected ones.

``pytest``: the ``-rA`` summary (``PASSED tests/x.py::test_a``, ``FAILED ... - msg``) and
verbose lines (``tests/x.py::test_a PASSED [ 50%]``), xdist prefixes included.
``generic``: pytest's forms plus unittest verbose (``test_a (pkg.mod.Case.test_a) ... ok``)
and ``go test -v`` (``--- PASS: TestA (0.00s)``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
NOT_RUN_OR_EXPECTED = frozenset({"SKIPPED", "XFAIL"})  # keep their status in all-pass mode
_S = "|".join(STATUSES)
_XDIST = r"(?:\[gw\d+\]\s+\[\s*\d+%\]\s+)?"
_SUMMARY = re.compile(rf"^{_XDIST}(?P<status>{_S})\s+(?P<rest>\S.*)$")
_VERBOSE = re.compile(
    rf"^(?P<id>\S[^\s:]*::\S.*?)\s+(?P<status>{_S})(?:\s+\(.*\))?(?:\s+\[\s*\d+%\])?\s*$"
)
_SKIP_SUMMARY = re.compile(r"^\[\d+\]\s")  # SKIPPED [1] path:line: reason (no test id)
_UNITTEST = re.compile(
    r"^(?P<name>\w+) \((?P<where>[\w.]+)\) \.\.\. "
    r"(?P<status>ok|FAIL|ERROR|skipped|expected failure|unexpected success)\b"
)
_UNITTEST_STATUS = {
    "ok": "PASSED",
    "FAIL": "FAILED",
    "ERROR": "ERROR",
    "skipped": "SKIPPED",
    "expected failure": "XFAIL",
    "unexpected success": "XPASS",
}
_GO = re.compile(r"^\s*--- (?P<status>PASS|FAIL|SKIP): (?P<name>\S+) \(")
_GO_STATUS = {"PASS": "PASSED", "FAIL": "FAILED", "SKIP": "SKIPPED"}


def _pytest_line(line: str) -> tuple[str, str] | None:
    m = _SUMMARY.match(line)
    if m:
        rest = m["rest"]
        if m["status"] == "SKIPPED" and _SKIP_SUMMARY.match(rest):
            return None
        test_id = rest.split(" - ", 1)[0].strip()
        if "::" not in test_id and " " in test_id:  # prose, not a test id
            return None
        return test_id, m["status"]
    m = _VERBOSE.match(line)
    if m:
        return m["id"].strip(), m["status"]
    return None


def _generic_line(line: str) -> tuple[str, str] | None:
    found = _pytest_line(line)
    if found:
        return found
    m = _UNITTEST.match(line)
    if m:
        where, name = m["where"], m["name"]
        test_id = where if where.endswith("." + name) else f"{where}.{name}"
        return test_id, _UNITTEST_STATUS[m["status"]]
    m = _GO.match(line)
    if m:
        return m["name"], _GO_STATUS[m["status"]]
    return None


PARSERS: dict[str, Callable[[str], tuple[str, str] | None]] = {
    "pytest": _pytest_line,
    "generic": _generic_line,
}


def parse_results(output: str, parser: str = "pytest") -> dict[str, str]:
    """Test id -> status; a test reported twice keeps its last status."""
    line_parser = PARSERS.get(parser)
    if line_parser is None:
        raise ValueError(f"unknown test output parser {parser!r}; use one of {sorted(PARSERS)}")
    results: dict[str, str] = {}
    for raw in output.splitlines():
        found = line_parser(raw.rstrip())
        if found:
            results[found[0]] = found[1]
    return results


def normalize_expected(expected: object) -> dict[str, str]:
    """Check the configured expectations: a mapping of test id -> one of STATUSES."""
    if not isinstance(expected, dict):
        raise ValueError(f"`expected` must map test ids to statuses, got {type(expected).__name__}")
    out = {}
    for test_id, status in expected.items():
        s = str(status).upper()
        if s not in STATUSES:
            raise ValueError(f"`expected[{test_id!r}]` is {status!r}; use one of {STATUSES}")
        out[str(test_id)] = s
    return out


def compare(
    expected: dict[str, str], actual: dict[str, str], match: str = "exact"
) -> tuple[float, dict[str, Any]]:
    """(reward, details). ``exact``: 1.0 only if every expected test has its expected
    status; ``fraction``: the share that does. With no expectations, every test that ran
    must pass (skipped and xfailed ones keep their status), and at least one must run."""
    if match not in ("exact", "fraction"):
        raise ValueError(f"`match` must be 'exact' or 'fraction', not {match!r}")
    if not expected:
        expected = {t: s if s in NOT_RUN_OR_EXPECTED else "PASSED" for t, s in actual.items()}
    mismatches = {
        t: {"expected": want, "actual": actual.get(t, "MISSING")}
        for t, want in expected.items()
        if actual.get(t) != want
    }
    total = len(expected)
    matched = total - len(mismatches)
    if match == "exact":
        reward = 1.0 if total and not mismatches else 0.0
    else:
        reward = matched / total if total else 0.0
    details = {
        "tests_expected": total,
        "tests_matched": matched,
        "tests_ran": len(actual),
        "mismatches": dict(list(mismatches.items())[:50]),
    }
    return reward, details
