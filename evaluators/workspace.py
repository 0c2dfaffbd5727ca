"""Putting the agent's output into an eval runtime, and running commands there.

In a live runtime the agent's changes are already in place; in a fresh one they are
applied from the session's artifacts: the diff (``git apply``) or the collected files.
"""

from __future__ import annotations

import posixpath
from typing import Any

from evaluators.base import EvalContext, EvaluatorError

APPLY_MODES = ("auto", "diff", "files", "none")
OUTPUT_TAIL = 4000


def apply_mode(configured: object, runtime_kind: str | None) -> str:
    mode = str(configured or "auto")
    if mode not in APPLY_MODES:
        raise EvaluatorError(f"`apply` must be one of {APPLY_MODES}, not {mode!r}")
    if mode == "auto":
        return "diff" if runtime_kind == "fresh" else "none"
    return mode


def eval_path(runtime: Any, name: str) -> str:
    """A scratch path for the evaluator's own files, outside the workdir."""
    return posixpath.join(runtime.home, ".polar-eval", name)


def tail(data: bytes | str, limit: int = OUTPUT_TAIL) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return text[-limit:]


async def apply_output(ctx: EvalContext, mode: str) -> dict[str, Any]:
    """Apply the session's output in ``ctx.runtime``; raises EvaluatorError if it fails."""
    if mode == "none":
        return {"applied": "none"}
    runtime = ctx.require_runtime()
    if mode == "files":
        for name, text in ctx.artifacts.files.items():
            await runtime.upload_file(name, text.encode())
        return {"applied": "files", "files": sorted(ctx.artifacts.files)}
    diff = ctx.artifacts.diff
    if not diff.strip():
        return {"applied": "nothing: the session's diff is empty"}
    path = eval_path(runtime, "agent.diff")
    await runtime.upload_file(
        path, diff.encode() if diff.endswith("\n") else (diff + "\n").encode()
    )
    # Never let git find a repository above the workdir: paths would resolve against it.
    env = {"GIT_CEILING_DIRECTORIES": posixpath.dirname(runtime.workdir)}
    result = await runtime.exec(
        ["git", "apply", "--whitespace=nowarn", path], env=env, timeout=ctx.remaining()
    )
    if not result.ok:
        why = tail(result.stderr or result.stdout, 1500).strip() or f"exit {result.exit_code}"
        raise EvaluatorError(f"the session's diff does not apply: {why}")
    return {"applied": "diff", "diff_bytes": len(diff)}


def command_timeout(ctx: EvalContext, configured: object) -> float:
    if configured is None:
        return ctx.remaining()
    try:
        seconds = float(configured)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise EvaluatorError(f"`timeout_seconds` must be a number, not {configured!r}") from None
    return min(seconds, ctx.remaining())


def command_of(config: dict[str, Any], key: str) -> str | list[str]:
    cmd = config.get(key)
    if isinstance(cmd, str) and cmd.strip():
        return cmd
    if isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd):
        return cmd
    raise EvaluatorError(f"config `{key}` must be a command line or a list of arguments")
