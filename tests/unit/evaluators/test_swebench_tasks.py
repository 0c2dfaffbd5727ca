"""SWE-bench / SWE-Gym instances -> Polar tasks: the task validates, the gold patch stays
out of it, an instance without an eval script gets one in SWE-bench's layout."""

import json

import orjson
import pytest

from evaluators.swebench_tasks import (
    eval_script_for,
    image_of,
    main,
    patched_test_files,
    polar_task,
)
from schemas import TaskRequest, decode_strict

TEST_PATCH = (
    "diff --git a/tests/test_a.py b/tests/test_a.py\n--- a/tests/test_a.py\n+++ b/tests/test_a.py\n"
    "@@ -1 +1,2 @@\n x = 1\n+y = 2\n"
    "diff --git a/tests/test_b.py b/tests/test_b.py\n--- a/tests/test_b.py\n+++ b/tests/test_b.py\n"
)
# the fields of a SWE-Gym / pre-5.x SWE-bench row (no image, no eval_script)
GYM = {
    "instance_id": "getmoto__moto-5752",
    "repo": "getmoto/moto",
    "base_commit": "b2300f1eae1323e3e8bc45f97e530ce129dff12e",
    "patch": "diff --git a/moto/x.py b/moto/x.py\nGOLD\n",
    "test_patch": TEST_PATCH,
    "problem_statement": "SSM get_parameters_by_path ignores a trailing slash",
    "FAIL_TO_PASS": '["tests/test_a.py::test_new"]',
    "PASS_TO_PASS": "[]",
    "version": "4.0",
}


def test_swe_gym_row_becomes_a_valid_task():
    task = polar_task(GYM, {"harness": "qwen_code", "model": "m"}, test_cmd="pytest -rA")
    req = decode_strict(orjson.dumps(task), TaskRequest)
    assert req.instruction == GYM["problem_statement"]
    assert req.runtime.image == "swebench/sweb.eval.x86_64.getmoto_1776_moto-5752:latest"
    assert req.runtime.workdir == "/testbed" and req.runtime.network == "host"
    assert (req.evaluator.name, req.evaluator.runtime) == ("swebench", "fresh")
    inst = req.evaluator.config["instance"]
    assert inst["FAIL_TO_PASS"] == GYM["FAIL_TO_PASS"]  # JSON strings pass through as given
    assert "GOLD" not in orjson.dumps(task).decode()  # the agent never sees the gold patch
    script = inst["eval_script"]
    assert (
        "git checkout b2300f1eae1323e3e8bc45f97e530ce129dff12e tests/test_a.py tests/test_b.py"
        in script
    )
    assert script.index(">>>>> Start Test Output") < script.index("pytest -rA tests/test_a.py")
    assert script.index("pytest -rA") < script.index(">>>>> End Test Output")


def test_swebench_5_row_keeps_its_own_image_and_script():
    row = {
        **GYM,
        "image": "reg/x:1",
        "eval_script": "#!/bin/bash\necho hi\n",
        "log_parser": "parse_log_django",
    }
    inst = polar_task(row, {"harness": "noop"})["evaluator"]["config"]["instance"]
    assert (inst["image"], inst["eval_script"], inst["log_parser"]) == (
        "reg/x:1",
        row["eval_script"],
        "parse_log_django",
    )
    with pytest.raises(ValueError, match="no eval_script in the instance; give test_cmd"):
        polar_task(GYM, {"harness": "noop"})


def test_helpers_and_cli(tmp_path, capsys):
    assert patched_test_files(TEST_PATCH) == ["tests/test_a.py", "tests/test_b.py"]
    assert image_of({"instance_id": "Django__django-1"}) == (
        "swebench/sweb.eval.x86_64.django_1776_django-1:latest"
    )
    assert "set -uxo pipefail" in eval_script_for(GYM, "pytest")
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps(GYM) + "\n" + json.dumps({**GYM, "instance_id": "other__x-1"}) + "\n")
    out = tmp_path / "tasks.jsonl"
    assert main([str(src), "--out", str(out), "--test-cmd", "pytest", "--ids", "other__x-1"]) == 0
    (line,) = out.read_text().splitlines()
    assert json.loads(line)["task_id"] == "other__x-1"
