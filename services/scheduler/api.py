"""The shapes of the scheduler's HTTP API, for its OpenAPI document (``/schema``).

The handlers read raw bodies (a refusal names the field, ``logic.parse_submission``) and
answer plain JSON, so litestar has nothing to infer: the document's schemas come from
msgspec, from the contract's own types (``TaskRequest``, ``TaskResult``, ``Session``) and
from the answers described here. The integration test converts every real answer into
these (unknown fields forbidden), so the document and the handlers cannot drift apart.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct

from schemas import SessionState, TaskRequest, TaskResult
from schemas.session import Session


class _Answer(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class Accepted(_Answer):
    task_id: str  # the task's id (generated when the request named none)
    session_ids: list[str]  # one per sample, in order


class ErrorBody(_Answer):
    message: str  # what was wrong
    field: str | None = None  # the request field the refusal is about, if any


class Error(_Answer):
    """Every refusal: a bad task (400), a missing or wrong token (401), no such task or
    session (404), a task id taken by another spec (409), a body over the limit (413)."""

    error: ErrorBody  # the refusal


class SessionSummary(_Answer):
    session_id: str  # the session
    state: SessionState  # its state now
    reward: float | None  # once evaluated
    reason: str | None  # why its run ended as it did
    eval_reason: str | None  # the evaluator's reason for the reward


class TaskView(_Answer):
    task_id: str  # the task
    status: str  # active, then the result's: completed | failed | cancelled | early_stopped
    submitted_at: float  # epoch seconds
    spec: TaskRequest  # as submitted, every env value redacted
    counts: dict[str, int]  # sessions by state
    sessions: list[SessionSummary]  # each session, in order
    result: TaskResult | None  # once the task has ended


class Cancelled(_Answer):
    task_id: str  # the task
    cancelled_sessions: int  # the live sessions this cancel ended


SESSION_VIEW = "SessionView"  # the registry's Session, less its token (a credential)
_TYPES = (TaskRequest, Accepted, Error, TaskView, Cancelled, Session)


def _any_json(tp: type) -> dict:
    if tp is object:  # dict[str, object]: settings, config, metadata
        return {"description": "any JSON value"}
    raise NotImplementedError  # msgspec's schema_hook protocol: no schema for this type


def components() -> dict[str, dict]:
    """Every schema the document names, by name. A submitted task's objects, at every
    depth, take no key they do not declare (``schemas.codec.decode_strict``)."""
    found = _schemas(_TYPES)
    for name in _schemas((TaskRequest,)):
        if found[name].get("type") == "object":
            found[name] = {**found[name], "additionalProperties": False}
    session = found.pop("Session")
    found[SESSION_VIEW] = {
        **session,
        "title": SESSION_VIEW,
        "properties": {k: v for k, v in session["properties"].items() if k != "token"},
        "required": [k for k in session["required"] if k != "token"],
        "additionalProperties": False,
    }
    return found


def _schemas(types: tuple[type, ...]) -> dict[str, dict]:
    template = "#/components/schemas/{name}"
    return msgspec.json.schema_components(types, ref_template=template, schema_hook=_any_json)[1]


def _refusals(*statuses: int) -> dict[int, tuple[str, str]]:
    why = {
        400: "the task is refused: the message says why, `field` names the field",
        401: "no token, or not the token this route needs",
        404: "no such task or session",
        409: "the task id is taken by a different task",
        413: "the body is over the limit (max_task_bytes)",
    }
    return {s: (why[s], "Error") for s in statuses}


SUBMIT = {
    201: ("accepted: the task's id and its sessions' ids", "Accepted"),
    **_refusals(400, 401, 409, 413),
}
TASK = {
    200: ("the task: spec, counts by state, sessions, result", "TaskView"),
    **_refusals(401, 404),
}
CANCEL = {200: ("the live sessions cancelled", "Cancelled"), **_refusals(401, 404)}
SESSION = {200: ("the session's registry record", SESSION_VIEW), **_refusals(401, 404)}
