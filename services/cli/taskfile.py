"""Task files and the submit bookkeeping, as plain functions (no network, no clock)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import orjson
import yaml

from schemas import (
    TERMINAL_STATES,
    ContractError,
    SessionState,
    TaskAccepted,
    TaskRejected,
    TaskRequest,
    decode,
    decode_strict,
)

STATE_ORDER = [s.value for s in SessionState]


class TaskFileError(ValueError):
    pass


@dataclass(frozen=True)
class TaskFile:
    payload: bytes  # what goes on the wire: JSON files verbatim, YAML converted
    task_id: str | None  # the file's own id, when it has one
    num_samples: int | None  # None when the file does not parse as an object


@dataclass(frozen=True)
class Submitted:
    task_id: str
    session_ids: list[str] = field(default_factory=list)
    duplicate: bool = False  # the same task was submitted before


@dataclass(frozen=True)
class Refused:
    reason: str
    field: str | None
    source: str  # who refused: "scheduler", "local check", "HTTP 400" ...


Answer = Submitted | Refused | None  # None: nobody answered in time


def read_task_file(path: Path) -> TaskFile:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TaskFileError(f"cannot read {path}: {exc.strerror}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            raw = orjson.dumps(yaml.safe_load(raw))
        except (yaml.YAMLError, TypeError) as exc:
            raise TaskFileError(f"{path}: not valid YAML for a task: {exc}") from None
    elif path.suffix.lower() != ".json":
        raise TaskFileError(f"{path}: a task file ends in .json, .yaml or .yml")
    return task_from_payload(raw)


def task_from_payload(payload: bytes) -> TaskFile:
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return TaskFile(payload, None, None)  # the scheduler says why
    if not isinstance(obj, dict):
        return TaskFile(payload, None, None)
    task_id = obj.get("task_id") if isinstance(obj.get("task_id"), str) else None
    n = obj.get("num_samples", 1)
    return TaskFile(payload, task_id, n if isinstance(n, int) else None)


def check_task(payload: bytes) -> ContractError | None:
    """The strict check the scheduler applies (unknown fields are errors), run before
    publishing so a person sees the error at once."""
    try:
        decode_strict(payload, TaskRequest)
    except ContractError as exc:
        return exc
    return None


def same_task(payload: bytes, task_id: str, registered: TaskRequest) -> bool:
    """Is ``payload`` (given ``task_id``) the task the registry already holds?"""
    try:
        ours = decode(payload, TaskRequest)
    except ContractError:
        return False
    return msgspec.structs.replace(ours, task_id=task_id) == registered


def new_task_id() -> str:
    return "t-" + uuid.uuid4().hex[:16]


def is_ours_accepted(event: TaskAccepted, task_id: str) -> bool:
    return event.task_id == task_id


def is_ours_rejected(event: TaskRejected, task_id: str, payload: bytes) -> bool:
    """A rejection names our task, or (for one that could not be parsed) quotes our payload."""
    if event.task_id is not None:
        return event.task_id == task_id
    return event.payload == payload.decode("utf-8", "replace")


def ordered_counts(counts: dict[str, int]) -> list[tuple[str, int]]:
    """Counts by state in lifecycle order; unknown states last, by name."""
    known = [(s, counts[s]) for s in STATE_ORDER if counts.get(s)]
    extra = sorted((s, n) for s, n in counts.items() if s not in STATE_ORDER and n)
    return known + extra


def finished(counts: dict[str, int]) -> int:
    return sum(n for s, n in counts.items() if s in TERMINAL_STATES)
