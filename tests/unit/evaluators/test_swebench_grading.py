"""SWE-bench grading of real eval logs (made by running the instance's eval script, as
the harness does) through the ``swebench`` package's own functions."""

from pathlib import Path

import pytest

from evaluators import EvaluatorError
from evaluators.swebench import grade_log, instance_of, load_swebench, make_spec, reward_of
from tests.unit.evaluators.calc_repo import swebench_instance

pytest.importorskip("swebench")
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def sw():
    grading, utils, constants = load_swebench()
    spec = make_spec(instance_of({"instance": swebench_instance("python")}), utils)
    return grading, constants, spec


def test_fixed_log_is_resolved(sw):
    grading, constants, spec = sw
    graded = grade_log((FIXTURES / "swebench_eval_fixed.log").read_text(), spec, grading, constants)
    assert graded["resolution"] == "RESOLVED_FULL"
    assert graded["report"]["FAIL_TO_PASS"] == {
        "success": ["test_calc.py::test_add"],
        "failure": [],
    }
    assert reward_of(graded, "resolved", constants) == 1.0


def test_buggy_log_is_not_resolved(sw):
    grading, constants, spec = sw
    graded = grade_log((FIXTURES / "swebench_eval_buggy.log").read_text(), spec, grading, constants)
    assert graded["resolution"] == "RESOLVED_NO"
    assert graded["report"]["FAIL_TO_PASS"]["failure"] == ["test_calc.py::test_add"]
    assert len(graded["report"]["PASS_TO_PASS"]["success"]) == 2
    assert reward_of(graded, "resolved", constants) == 0.0
    assert reward_of(graded, "fraction", constants) == pytest.approx(2 / 3)


def test_log_without_a_test_run_is_an_error(sw):
    grading, constants, spec = sw
    log = "+ cat\nbash: pytest: command not found\n"
    with pytest.raises(EvaluatorError, match="no gradeable test run in the eval log"):
        grade_log(log, spec, grading, constants)


def test_instance_checks():
    with pytest.raises(EvaluatorError, match="lacks FAIL_TO_PASS, eval_script"):
        instance_of({"instance_id": "x", "PASS_TO_PASS": []})
    _, utils, _ = load_swebench()
    bad = instance_of({**swebench_instance(), "log_parser": "parse_log_nothing"})
    with pytest.raises(EvaluatorError, match="unknown swebench log_parser"):
        make_spec(bad, utils)
    # the JSON-string lists of the HF datasets are accepted as well
    spec = make_spec(instance_of({**swebench_instance(), "FAIL_TO_PASS": '["a::b"]'}), utils)
    assert spec.FAIL_TO_PASS == ["a::b"]
