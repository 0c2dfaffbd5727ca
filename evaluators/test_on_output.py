"""``test_on_output``: apply the agent's output, run the tests, compare per-test results.

Config::

    test_command: "python -m pytest -rA tests"   # required (string or argv list)
    expected: {"tests/test_x.py::test_a": PASSED, ...}   # default: every test passes
    match: exact | fraction                       # default exact
    apply: auto | diff | files | none             # auto: diff in a fresh runtime
    parser: pytest | generic                      # default pytest
    timeout_seconds: 300                          # default: what is left of the eval timeout
    cwd: "."  env: {}

A run that yields no parseable test result, or whose command timed out, is an error
with the output's tail, not a zero.
"""

from __future__ import annotations

from evaluators.base import EvalContext, EvalResult, Evaluator, EvaluatorError
from evaluators.testparse import compare, normalize_expected, parse_results
from evaluators.workspace import apply_mode, apply_output, command_of, command_timeout, tail


class TestOnOutput(Evaluator):
    __test__ = False  # not a pytest test class, despite the name
    name = "test_on_output"
    needs_runtime = "task"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        cfg = ctx.config
        command = command_of(cfg, "test_command")
        try:
            expected = normalize_expected(cfg.get("expected") or {})
            match = str(cfg.get("match", "exact"))
            parser = str(cfg.get("parser", "pytest"))
            compare({}, {}, match)  # validates `match` before any work is done
            parse_results("", parser)
        except ValueError as exc:
            raise EvaluatorError(str(exc)) from None
        applied = await apply_output(ctx, apply_mode(cfg.get("apply"), ctx.runtime_kind))
        timeout = command_timeout(ctx, cfg.get("timeout_seconds"))
        run = await ctx.require_runtime().exec(
            command, cwd=cfg.get("cwd"), env=dict(cfg.get("env") or {}), timeout=timeout
        )
        output = (
            run.stdout.decode("utf-8", "replace") + "\n" + run.stderr.decode("utf-8", "replace")
        )
        if run.timed_out:
            raise EvaluatorError(
                f"test command timed out after {timeout:.0f}s: {tail(output, 1500)}"
            )
        actual = parse_results(output, parser)
        if not actual:
            raise EvaluatorError(
                f"no test results in the test command's output (exit {run.exit_code}): "
                f"{tail(output, 1500)}"
            )
        reward, details = compare(expected, actual, match)
        reason = (
            None
            if reward == 1.0
            else f"{details['tests_matched']}/{details['tests_expected']} tests as expected"
        )
        return EvalResult.ok(reward, reason, exit_code=run.exit_code, **applied, **details)
