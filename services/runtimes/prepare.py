"""Prepare actions (upload file, upload dir, exec with retries and backoff), logged per action.

`run_prepare` runs the actions in order and stops at the first that fails for good. It
returns one `ActionLog` per action it ran; failure is data, never an exception (except
`RuntimeStopped`: the runtime is gone and nothing more can be done).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import msgspec

from schemas.task import ExecAction, PrepareAction, UploadDir, UploadFile
from services.runtimes.base import Runtime
from services.runtimes.errors import RuntimeStopped, SandboxError

MAX_BACKOFF_SECONDS = 300.0
LOG_TAIL_BYTES = 64 * 1024

Sleep = Callable[[float], Awaitable[object]]


class AttemptLog(msgspec.Struct, frozen=True, omit_defaults=True):
    attempt: int
    ok: bool
    duration: float
    exit_code: int | None = None
    timed_out: bool = False
    stdout: str = ""
    stderr: str = ""
    error: str | None = None


class ActionLog(msgspec.Struct, frozen=True):
    index: int
    action: str  # the action's tag: upload_file | upload_dir | exec
    target: str  # destination or command, for people reading the log
    ok: bool
    attempts: list[AttemptLog]
    duration: float


def backoff_delay(base: float, attempt: int) -> float:
    """Delay before retry number `attempt` (0-based): base, 2*base, 4*base, ... capped."""
    return min(base * 2**attempt, MAX_BACKOFF_SECONDS)


def _tail(data: bytes) -> str:
    return data[-LOG_TAIL_BYTES:].decode("utf-8", errors="replace")


async def _once(attempt: int, work: Callable[[], Awaitable[None]]) -> AttemptLog:
    started = time.monotonic()
    try:
        await work()
    except RuntimeStopped:
        raise
    except SandboxError as exc:
        return AttemptLog(attempt, False, time.monotonic() - started, error=str(exc))
    return AttemptLog(attempt, True, time.monotonic() - started)


async def _upload_file(runtime: Runtime, action: UploadFile, sleep: Sleep) -> list[AttemptLog]:
    async def work() -> None:
        if action.content is not None:
            await runtime.upload_file(action.dest, action.content.encode(), mode=action.mode)
        else:
            await runtime.upload_file(action.dest, src=Path(str(action.src)), mode=action.mode)

    return [await _once(0, work)]


async def _upload_dir(runtime: Runtime, action: UploadDir, sleep: Sleep) -> list[AttemptLog]:
    return [await _once(0, lambda: runtime.upload_dir(Path(action.src), action.dest))]


async def _exec_attempt(runtime: Runtime, action: ExecAction, attempt: int) -> AttemptLog:
    try:
        r = await runtime.exec(
            action.command, cwd=action.cwd, env=action.env, timeout=action.timeout_seconds,
            network=action.network,
        )  # fmt: skip
    except RuntimeStopped:
        raise
    except SandboxError as exc:
        return AttemptLog(attempt, False, 0.0, error=str(exc))
    return AttemptLog(
        attempt, r.ok, r.duration, r.exit_code, r.timed_out, _tail(r.stdout), _tail(r.stderr)
    )


async def _exec(runtime: Runtime, action: ExecAction, sleep: Sleep) -> list[AttemptLog]:
    attempts = []
    for attempt in range(action.retries + 1):
        if attempt:
            await sleep(backoff_delay(action.backoff_seconds, attempt - 1))
        attempts.append(await _exec_attempt(runtime, action, attempt))
        if attempts[-1].ok:
            break
    return attempts


_HANDLERS: dict[type, Callable[..., Awaitable[list[AttemptLog]]]] = {
    UploadFile: _upload_file,
    UploadDir: _upload_dir,
    ExecAction: _exec,
}


def _target(action: PrepareAction) -> str:
    if isinstance(action, ExecAction):
        cmd = action.command
        return cmd if isinstance(cmd, str) else " ".join(cmd)
    return action.dest


async def run_prepare(
    runtime: Runtime,
    actions: Sequence[PrepareAction],
    *,
    log_dir: Path | None = None,
    sleep: Sleep = asyncio.sleep,
) -> list[ActionLog]:
    """Run `actions` in order; stop after the first that fails all its attempts."""
    logs: list[ActionLog] = []
    for index, action in enumerate(actions):
        started = time.monotonic()
        attempts = await _HANDLERS[type(action)](runtime, action, sleep)
        tag = type(action).__struct_config__.tag
        log = ActionLog(
            index, str(tag), _target(action), attempts[-1].ok, attempts, time.monotonic() - started
        )
        logs.append(log)
        if log_dir is not None:
            write_action_log(log_dir, log)
        if not log.ok:
            break
    return logs


def write_action_log(log_dir: Path, log: ActionLog) -> Path:
    """One JSON file per action: `prepare-<index>-<action>.json`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"prepare-{log.index:02d}-{log.action}.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(log)))
    return path
