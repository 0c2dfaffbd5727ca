"""Scheduler service: ``polar serve scheduler``.

Consumes ``polar.tasks.submit`` and ``polar.tasks.cancel``, tracks sessions to their end
through terminal state events, publishes TaskResults; HTTP API with its OpenAPI document
at /schema/openapi.json and Swagger UI at /schema (served offline; shapes: ``api.py``).
"""

from __future__ import annotations

import msgspec
from litestar import Litestar, Request, Response, delete, get, post
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException, NotAuthorizedException
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath

from schemas import TERMINAL_STATES, encode
from schemas import subjects as S
from services.common import auth
from services.common.bus import work_consumer
from services.common.consumer import Consumer
from services.common.host import Declared, Every, ServiceHost, service_app
from services.common.http import BEARER, api_docs, operation
from services.common.redact import redact_env
from services.common.settings import load
from services.scheduler import api, logic
from services.scheduler.config import SchedulerConfig
from services.scheduler.handlers import Scheduler


def consumers(sched: Scheduler) -> list[Consumer]:
    bus = sched.bus
    events = work_consumer(S.CONSUMER_SCHEDULER_EVENTS, S.SESSION_EVENTS, max_deliver=10)
    events.filter_subject = None
    events.filter_subjects = [S.session_event(s) for s in sorted(TERMINAL_STATES)]
    return [
        Consumer(
            bus,
            S.STREAM_TASKS,
            work_consumer(S.CONSUMER_SCHEDULER_SUBMIT, S.TASKS_SUBMIT),
            sched.on_submit,
            concurrency=8,
            on_quarantine=sched.on_submit_quarantined,
        ),
        Consumer(
            bus,
            S.STREAM_TASKS,
            work_consumer(S.CONSUMER_SCHEDULER_CANCEL, S.TASKS_CANCEL),
            sched.on_cancel,
            concurrency=4,
        ),
        Consumer(bus, S.STREAM_EVENTS, events, sched.on_session_event, concurrency=8),
    ]


def _error(status: int, message: str, field: str | None = None) -> Response:
    return Response({"error": {"message": message, "field": field}}, status_code=status)


def _sched(request: Request) -> Scheduler:
    return request.app.state.scheduler


def credential_guard(config: SchedulerConfig):
    """Every route that names a ``role`` in its ``opt`` needs that role's bearer token
    (the ops routes name none: health and metrics stay open)."""

    def guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
        role = handler.opt.get("role")
        if role is None:
            return
        why = auth.refusal(
            role,
            connection.headers,
            admin_token=config.admin_token,
            read_token=config.read_token,
            service="scheduler",
        )
        if why is not None:
            raise NotAuthorizedException(why)

    return guard


def _refused(_: Request, exc: NotAuthorizedException) -> Response:
    """A refused credential in the API's own error shape."""
    response = _error(401, exc.detail)
    response.headers["www-authenticate"] = "Bearer"
    return response


def _http_error(request: Request, exc: HTTPException) -> Response:
    """Litestar's own refusals (a body over the limit, an unknown route or method) in
    the API's error shape; a body over the limit names the limit."""
    message = exc.detail
    if exc.status_code == 413:
        limit = _sched(request).config.max_task_bytes
        message = f"the task is larger than the limit of {limit} bytes (max_task_bytes)"
    return _error(exc.status_code, message)


@post(
    "/tasks",
    status_code=201,
    summary="Submit a task (TaskRequest JSON)",
    opt={"role": auth.ADMIN},
    security=BEARER,
    operation_class=operation(body="TaskRequest", responses=api.SUBMIT),
)
async def submit_task(request: Request) -> Response:
    sched = _sched(request)
    raw = await request.body()
    parsed = await sched.parse(raw)
    if isinstance(parsed, logic.Rejection):
        return _error(400, parsed.reason, parsed.field)
    result = await sched.accept(logic.with_task_id(parsed))
    if isinstance(result, logic.Rejection):
        return _error(409, result.reason, result.field)
    return Response(
        {"task_id": result[0].task_id, "session_ids": [s.session_id for s in result]},
        status_code=201,
    )


@get(
    "/tasks/{task_id:str}",
    summary="A task: spec (env values redacted), counts by state, sessions, result",
    opt={"role": auth.READ},
    security=BEARER,
    operation_class=operation(responses=api.TASK),
)
async def get_task(request: Request, task_id: FromPath[str]) -> Response:
    reg = _sched(request).registry
    task = await reg.get_task(task_id)
    if task is None:
        return _error(404, f"no task {task_id!r}")
    sessions = await reg.task_sessions(task_id)
    body = {
        "task_id": task_id,
        "status": task.status,
        "submitted_at": task.submitted_at,
        "spec": redact_env(msgspec.to_builtins(task.spec)),  # env holds the task's secrets
        "counts": await reg.task_counts(task_id),
        "sessions": [
            {
                "session_id": s.session_id,
                "state": s.state,
                "reward": s.reward,
                "reason": s.reason,
                "eval_reason": s.eval_reason,
            }
            for s in sessions
        ],
        "result": None,
    }
    raw = encode(body)
    if task.result:  # splice the stored TaskResult JSON in verbatim
        raw = raw[: -len(b"null}")] + task.result + b"}"
    return Response(raw, media_type="application/json")


@delete(
    "/tasks/{task_id:str}",
    status_code=200,
    summary="Cancel a task's live sessions",
    opt={"role": auth.ADMIN},
    security=BEARER,
    operation_class=operation(responses=api.CANCEL),
)
async def cancel_task(request: Request, task_id: FromPath[str]) -> Response:
    cancelled = await _sched(request).cancel_task(task_id, "cancelled over HTTP")
    if cancelled is None:
        return _error(404, f"no task {task_id!r}")
    return Response({"task_id": task_id, "cancelled_sessions": cancelled})


@get(
    "/sessions/{session_id:str}",
    summary="One session's registry record",
    opt={"role": auth.READ},
    security=BEARER,
    operation_class=operation(responses=api.SESSION),
)
async def get_session(request: Request, session_id: FromPath[str]) -> Response:
    session = await _sched(request).registry.get_session(session_id)
    if session is None:
        return _error(404, f"no session {session_id!r}")
    data = {f: getattr(session, f) for f in session.__struct_fields__ if f != "token"}
    return Response(data)  # the token is a credential: never served


def create_app(config: SchedulerConfig | None = None) -> Litestar:
    cfg = config or load(SchedulerConfig)
    docs, docs_assets = api_docs("Polar scheduler", "1", api.components())

    async def build(host: ServiceHost) -> Declared:
        sched = Scheduler(host.bus, host.registry, cfg)
        return Declared(
            sched,
            consumers=consumers(sched),
            jobs=[Every(cfg.reconcile_interval_seconds, sched.reconcile, "reconcile")],
        )

    return service_app(
        "scheduler",
        cfg,
        build,
        routes=[submit_task, get_task, cancel_task, get_session, docs_assets],
        guards=[credential_guard(cfg)],
        exception_handlers={NotAuthorizedException: _refused, HTTPException: _http_error},
        openapi_config=docs,
        request_max_body_size=cfg.max_task_bytes,  # a 413 past it (_http_error)
    )
