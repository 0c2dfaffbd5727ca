"""Per-test results parsed from real runner output, and the comparison to expectations."""

from pathlib import Path

import pytest

from evaluators.testparse import compare, normalize_expected, parse_results

FIXTURES = Path(__file__).parent / "fixtures"


def test_pytest_verbose_and_summary_lines():
    out = (FIXTURES / "pytest_verbose_rA.txt").read_text()
    assert parse_results(out, "pytest") == {
        "test_calc.py::test_add": "FAILED",
        "test_calc.py::test_div": "PASSED",
        "test_calc.py::test_add_param[1-2]": "FAILED",
        "test_calc.py::test_add_param[3-4]": "FAILED",
        "test_calc.py::test_skipped": "SKIPPED",
        "test_calc.py::test_xfail": "XFAIL",
        "test_calc.py::test_error": "ERROR",
    }


def test_pytest_summary_only_skips_the_skip_reason_line():
    out = "\n".join(
        [
            "PASSED tests/a.py::test_x",
            "SKIPPED [1] tests/a.py:19: not today",
            "FAILED tests/a.py::test_y[a b] - AssertionError: no - really",
            "[gw1] [ 50%] PASSED tests/b.py::test_z",
            "FAILED some prose that is not a test",
        ]
    )
    assert parse_results(out) == {
        "tests/a.py::test_x": "PASSED",
        "tests/a.py::test_y[a b]": "FAILED",
        "tests/b.py::test_z": "PASSED",
    }


def test_generic_reads_unittest_and_go():
    out = (FIXTURES / "unittest_verbose.txt").read_text()
    out += "\n=== RUN   TestAdd\n--- PASS: TestAdd (0.00s)\n    --- FAIL: TestAdd/neg (0.01s)\n"
    assert parse_results(out, "generic") == {
        "test_ut.TestCalc.test_error": "ERROR",
        "test_ut.TestCalc.test_fail": "FAILED",
        "test_ut.TestCalc.test_ok": "PASSED",
        "test_ut.TestCalc.test_skip": "SKIPPED",
        "test_ut.TestCalc.test_xf": "XFAIL",
        "TestAdd": "PASSED",
        "TestAdd/neg": "FAILED",
    }
    assert parse_results(out, "pytest") == {}  # pytest's parser does not read those


def test_unknown_parser():
    with pytest.raises(ValueError, match="unknown test output parser 'junit'"):
        parse_results("", "junit")


def test_exact_and_fraction():
    expected = {"a": "PASSED", "b": "PASSED", "c": "FAILED", "d": "PASSED"}
    actual = {"a": "PASSED", "b": "FAILED", "c": "FAILED"}
    reward, details = compare(expected, actual, "exact")
    assert reward == 0.0
    assert details["tests_matched"] == 2 and details["tests_expected"] == 4
    assert details["mismatches"] == {
        "b": {"expected": "PASSED", "actual": "FAILED"},
        "d": {"expected": "PASSED", "actual": "MISSING"},
    }
    assert compare(expected, actual, "fraction")[0] == 0.5
    assert compare({"a": "PASSED"}, actual, "exact")[0] == 1.0


def test_without_expectations_every_test_that_ran_must_pass():
    assert compare({}, {"a": "PASSED", "s": "SKIPPED", "x": "XFAIL"})[0] == 1.0
    assert compare({}, {"a": "PASSED", "b": "ERROR"})[0] == 0.0
    assert compare({}, {"a": "PASSED", "b": "ERROR"}, "fraction")[0] == 0.5
    assert compare({}, {})[0] == 0.0


def test_expectations_are_checked():
    assert normalize_expected({"a": "passed"}) == {"a": "PASSED"}
    with pytest.raises(ValueError, match="expected\\['a'\\]"):
        normalize_expected({"a": "GREEN"})
    with pytest.raises(ValueError, match="must map test ids"):
        normalize_expected(["a"])
    with pytest.raises(ValueError, match="`match`"):
        compare({}, {}, "most")
