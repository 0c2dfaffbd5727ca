"""``swebench``: SWE-bench / SWE-Gym grading with the ``swebench`` package's own logic.

Needs the optional extra: ``pip install 'polar-rollout[swebench]'``. The agent's patch is
applied (in a fresh runtime; a live one has it already), the instance's eval script runs
in the runtime, and its log is graded by ``swebench.harness.grading``: the status map
(``get_logs_eval``), FAIL_TO_PASS / PASS_TO_PASS (``get_eval_tests_report``) and the
resolution (``get_resolution_status``).

Config: the instance (``instance_id``, ``FAIL_TO_PASS``, ``PASS_TO_PASS``, ``eval_script``,
optional ``log_parser`` (default ``parse_log_pytest``), ``eval_type``, ``repo``,
``version``, ``image``), either under ``instance`` or at the top level; ``reward``:
``resolved`` (1.0 when fully resolved, default) or ``fraction`` (share of F2P and P2P tests
that pass); ``apply``, ``timeout_seconds``.
"""

from __future__ import annotations

import asyncio
import importlib
import shlex
import tempfile
from pathlib import Path
from typing import Any

from evaluators.base import EvalContext, EvalResult, Evaluator, EvaluatorError
from evaluators.workspace import apply_mode, apply_output, command_timeout, eval_path, tail

INSTALL_HINT = "install the optional extra: pip install 'polar-rollout[swebench]'"
INSTANCE_KEYS = (
    "instance_id", "FAIL_TO_PASS", "PASS_TO_PASS", "eval_script", "log_parser",
    "eval_type", "repo", "version", "image",
)  # fmt: skip
DEFAULTS = {
    "log_parser": "parse_log_pytest",
    "eval_type": "pass_and_fail",
    "repo": "",
    "version": "",
    "image": "",
}


def load_swebench() -> tuple[Any, Any, Any]:
    try:
        grading = importlib.import_module("swebench.harness.grading")
        utils = importlib.import_module("swebench.harness.utils")
        constants = importlib.import_module("swebench.harness.constants")
    except ImportError as exc:
        raise EvaluatorError(
            f"the swebench evaluator cannot import swebench ({exc}); {INSTALL_HINT}"
        ) from None
    return grading, utils, constants


def instance_of(config: dict[str, Any]) -> dict[str, Any]:
    inst = config.get("instance", config)
    if not isinstance(inst, dict):
        raise EvaluatorError("`instance` must be an object with the SWE-bench instance fields")
    data = {**DEFAULTS, **{k: inst[k] for k in INSTANCE_KEYS if k in inst}}
    missing = [
        k for k in ("instance_id", "FAIL_TO_PASS", "PASS_TO_PASS", "eval_script") if k not in data
    ]
    if missing:
        raise EvaluatorError(f"the SWE-bench instance lacks {', '.join(missing)}")
    return data


def make_spec(instance: dict[str, Any], utils: Any) -> Any:
    try:
        spec = utils.make_test_spec(instance)
    except (KeyError, ValueError, TypeError) as exc:
        raise EvaluatorError(f"bad SWE-bench instance: {exc!r}") from None
    parsers = importlib.import_module("swebench.harness.log_parsers").PARSER_REGISTRY
    if spec.log_parser not in parsers:
        raise EvaluatorError(f"unknown swebench log_parser {spec.log_parser!r}")
    return spec


def grade_log(log: str, spec: Any, grading: Any, constants: Any) -> dict[str, Any]:
    """The swebench report of one eval log: resolution, F2P/P2P successes and failures.
    Raises EvaluatorError when the log holds no gradeable test run."""
    with tempfile.TemporaryDirectory(prefix="polar-swebench-") as tmp:
        path = Path(tmp) / "eval.log"
        path.write_text(log)
        status_map, found = grading.get_logs_eval(spec, str(path))
        if not found:
            infra = importlib.import_module("swebench.harness.infra_failure").classify_logs(path)
            why = f" ({infra[0]}, {infra[1]})" if infra else ""
            raise EvaluatorError(f"no gradeable test run in the eval log{why}: {tail(log, 1500)}")
    gold = {
        constants.FAIL_TO_PASS: spec.FAIL_TO_PASS,
        constants.PASS_TO_PASS: spec.PASS_TO_PASS,
    }
    report = grading.get_eval_tests_report(
        status_map, gold, eval_type=constants.EvalType(spec.eval_type)
    )
    return {"resolution": grading.get_resolution_status(report), "report": report}


def reward_of(graded: dict[str, Any], mode: str, constants: Any) -> float:
    if mode == "resolved":
        return 1.0 if graded["resolution"] == constants.ResolvedStatus.FULL.value else 0.0
    report = graded["report"]
    parts = [report[constants.FAIL_TO_PASS], report[constants.PASS_TO_PASS]]
    ok = sum(len(p["success"]) for p in parts)
    total = ok + sum(len(p["failure"]) for p in parts)
    return ok / total if total else 1.0


class SweBench(Evaluator):
    name = "swebench"
    needs_runtime = "task"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        mode = str(ctx.config.get("reward", "resolved"))
        if mode not in ("resolved", "fraction"):
            raise EvaluatorError(f"`reward` must be resolved or fraction, not {mode!r}")
        grading, utils, constants = await asyncio.to_thread(load_swebench)  # a slow import
        spec = make_spec(instance_of(ctx.config), utils)
        applied = await apply_output(ctx, apply_mode(ctx.config.get("apply"), ctx.runtime_kind))
        log = await self._run_eval_script(ctx, spec.eval_script)
        graded = await asyncio.to_thread(grade_log, log, spec, grading, constants)
        reward = reward_of(graded, mode, constants)
        report = graded["report"]
        return EvalResult.ok(
            reward,
            None if reward == 1.0 else f"swebench: {graded['resolution']}",
            instance_id=spec.instance_id,
            resolution=graded["resolution"],
            fail_to_pass=report[constants.FAIL_TO_PASS],
            pass_to_pass=report[constants.PASS_TO_PASS],
            **applied,
        )

    async def _run_eval_script(self, ctx: EvalContext, script: str) -> str:
        runtime = ctx.require_runtime()
        path = eval_path(runtime, "eval.sh")
        await runtime.upload_file(path, script.encode(), mode=0o755)
        timeout = command_timeout(ctx, ctx.config.get("timeout_seconds"))
        run = await runtime.exec(f"bash {shlex.quote(path)} 2>&1", timeout=timeout)
        log = run.stdout.decode("utf-8", "replace")
        if run.timed_out:
            raise EvaluatorError(
                f"the eval script timed out after {timeout:.0f}s: {tail(log, 1500)}"
            )
        return log
