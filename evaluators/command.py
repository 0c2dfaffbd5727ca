"""``command``: run any command in the eval runtime; the reward is what it reports.

Config::

    command: "python score.py"        # required (string or argv list)
    reward_from: stdout | json_file   # default stdout
    json_path: "out/score.json"       # json_file: the file the command writes
    json_key: "reward"                # dotted key in the JSON (default "reward")
    apply: auto | diff | files | none
    allow_failure: false              # a non-zero exit is an error unless true
    timeout_seconds, cwd, env

With ``stdout``, the last non-empty line is the reward: a number, or a JSON object
holding ``json_key``. Anything else is an error naming what was found.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from evaluators.base import EvalContext, EvalResult, Evaluator, EvaluatorError
from evaluators.workspace import apply_mode, apply_output, command_of, command_timeout, tail


def reward_from_json(data: Any, key: str) -> float:
    value = data
    for part in key.split(".") if key else []:
        if not isinstance(value, dict) or part not in value:
            raise EvaluatorError(
                f"no key {key!r} in the command's JSON ({tail(orjson.dumps(data), 200)})"
            )
        value = value[part]
    return as_reward(value, f"JSON key {key!r}")


def as_reward(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EvaluatorError(f"{where} is {value!r}, not a number")
    if not math.isfinite(value):
        raise EvaluatorError(f"{where} is {value!r}, not a finite number")
    return float(value)


def reward_from_stdout(stdout: str, key: str) -> float:
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise EvaluatorError("the command printed nothing: no reward")
    last = lines[-1]
    try:
        return as_reward(float(last), "the last line")
    except ValueError:
        pass
    try:
        data = orjson.loads(last)
    except orjson.JSONDecodeError:
        raise EvaluatorError(
            f"the last line is neither a number nor JSON: {last[:200]!r}"
        ) from None
    if isinstance(data, dict):
        return reward_from_json(data, key)
    return as_reward(data, "the last line")


class CommandEvaluator(Evaluator):
    name = "command"
    needs_runtime = "task"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        cfg = ctx.config
        command = command_of(cfg, "command")
        source = str(cfg.get("reward_from", "stdout"))
        if source not in ("stdout", "json_file"):
            raise EvaluatorError(f"`reward_from` must be stdout or json_file, not {source!r}")
        if source == "json_file" and not cfg.get("json_path"):
            raise EvaluatorError("`reward_from: json_file` needs `json_path`")
        applied = await apply_output(ctx, apply_mode(cfg.get("apply"), ctx.runtime_kind))
        runtime = ctx.require_runtime()
        timeout = command_timeout(ctx, cfg.get("timeout_seconds"))
        run = await runtime.exec(
            command, cwd=cfg.get("cwd"), env=dict(cfg.get("env") or {}), timeout=timeout
        )
        stdout = run.stdout.decode("utf-8", "replace")
        if run.timed_out:
            raise EvaluatorError(f"command timed out after {timeout:.0f}s")
        if run.exit_code != 0 and not cfg.get("allow_failure"):
            raise EvaluatorError(
                f"command exited {run.exit_code}: {tail(run.stderr or stdout, 1500)}"
            )
        key = str(cfg.get("json_key", "reward"))
        if source == "stdout":
            reward = reward_from_stdout(stdout, key)
        else:
            reward = reward_from_json(await self._read_json(runtime, str(cfg["json_path"])), key)
        return EvalResult.ok(
            reward, exit_code=run.exit_code, stdout_tail=tail(stdout, 500), **applied
        )

    async def _read_json(self, runtime: Any, path: str) -> Any:
        try:
            raw = await runtime.download(path)
        except Exception as exc:  # noqa: BLE001 - a runtime I/O error, reported as the reason
            raise EvaluatorError(f"cannot read {path!r} from the eval runtime: {exc}") from None
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise EvaluatorError(f"{path!r} is not JSON: {exc}") from None
