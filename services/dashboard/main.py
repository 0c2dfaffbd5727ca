"""The dashboard service: ``polar dashboard`` / ``polar serve dashboard``.

A thin HTTP shell over ``reader`` (what it reads) and ``views`` (what each page shows):
pages are one static HTML shell each whose script (``static/app.js``, no build step)
fetches ``/api/...`` JSON and listens to ``/api/live`` (server-sent events) for changes.
Pages and the API answer 404 for an unknown task or session. Every page and ``/api``
route needs the stack's read token (``access.py``: a bearer token, or the cookie the sign-in
link ``polar dashboard`` prints gives a browser; without one a page is the sign-in page and
the API a 401); a cancel is a POST with the stack's admin token as a bearer token (none
configured: refused); the pages carry a strict Content-Security-Policy, so injected
markup could not run a script even if it got in.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from litestar import Litestar, MediaType, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.response import ServerSentEvent
from litestar.static_files import create_static_files_router
from prometheus_client import Counter, Gauge, Histogram

from schemas import Outcome
from services.common.auth import ADMIN, refusal
from services.common.http import ops_routes
from services.common.logs import service_logging
from services.common.redact import Scrubber
from services.common.settings import load
from services.dashboard import training, trajectory, views
from services.dashboard.access import TICKET_PARAM, Access, cookie_header, without_ticket
from services.dashboard.config import DashboardConfig
from services.dashboard.index import ENDED, BadQuery, parse_query
from services.dashboard.reader import StackReader

STATIC = resources.files(__package__).joinpath("static")
PAGES = ("overview", "task", "session", "trajectory", "training", "topology")
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'"
)
# secrets by shape only: the lists (each row's reasons were scrubbed with its own task's
# secrets as it entered the index, reader._scrub_reasons)
SHAPES = Scrubber()
LINEAGE_READS = 10  # a session page reads the records of its last 10 replays (divergences)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

API_SECONDS = Histogram(
    "polar_dashboard_api_seconds", "Time to answer one dashboard API call", ["route"]
)
LIVE_CLIENTS = Gauge("polar_dashboard_live_clients", "Browsers following /api/live")
CANCELS = Counter("polar_dashboard_cancels_total", "Cancels sent from the dashboard", ["result"])
SESSIONS = Gauge("polar_dashboard_sessions", "Sessions in the dashboard's index")
CANCEL_NEEDS = (
    "a cancel needs the stack's admin token (admin_token in <state_dir>/credentials.json), "
    "not the read token that signs you in"
)


def page_html(page: str, **data: str) -> str:
    """A page's shell: the page name and its ids as data attributes the script reads."""
    import html

    attrs = " ".join(f'data-{k}="{html.escape(v, quote=True)}"' for k, v in data.items())
    return (
        STATIC.joinpath("page.html")
        .read_text()
        .replace("{{page}}", html.escape(page))
        .replace("{{attrs}}", attrs)
    )


def html_page(page: str, status: int = 200, **data: str) -> Response:
    return Response(
        page_html(page, **data),
        status_code=status,
        media_type=MediaType.HTML,
        headers=SECURITY_HEADERS,
    )


def unauthorized(why: str, api: bool) -> Response:
    """The API's 401 (litestar's error shape, as the cancel's), or the sign-in page."""
    if not api:
        return html_page("signin", 401, why=why)
    return Response(
        {"status_code": 401, "detail": why},
        status_code=401,
        headers={**SECURITY_HEADERS, "WWW-Authenticate": "Bearer"},
    )


def not_found(what: str) -> HTTPException:
    return HTTPException(status_code=404, detail=what)


def create_app(config: DashboardConfig | None = None) -> Litestar:
    cfg = config or load(DashboardConfig)
    reader = StackReader(cfg)
    access = Access(cfg)

    @asynccontextmanager
    async def lifespan(app: Litestar):
        await reader.start()
        try:
            yield
        finally:
            await reader.stop()

    async def health() -> dict[str, object]:
        bus = reader.bus
        return {
            "nats": bool(bus and bus.nc.is_connected),
            "redis": reader.redis_error is None,
            "index": {"ok": True, "sessions": len(reader.index.rows), "loaded": reader.loaded},
        }

    async def gate(request: Request) -> Response | None:
        """Before every route: the open ones pass, a sign-in link is redeemed for a cookie,
        anything else needs a credential (None: go on to the route)."""
        if request.route_handler.opt.get("open"):
            return None
        if request.route_handler.opt.get("admin"):
            return None  # the route itself asks for the admin token, and says so
        now, path = time.time(), request.url.path
        is_api = path == "/api" or path.startswith("/api/")
        why = access.refusal(request.headers, request.cookies, now=now)
        ticket = request.query_params.get(TICKET_PARAM)
        if ticket is not None and not is_api and request.method == "GET":
            cookie, bad = await access.sign_in(ticket, reader.registry.use_ticket, now=now)
            if bad is not None and why is not None:
                return unauthorized(bad, api=False)
            headers = {
                **SECURITY_HEADERS,
                "Location": without_ticket(path, request.query_params.multi_items()),
                "Cache-Control": "no-store",
            }
            if cookie is not None:
                secure = request.url.scheme == "https"
                headers["Set-Cookie"] = cookie_header(access.cookie_name, cookie, secure=secure)
            return Response(b"", status_code=303, headers=headers, media_type=MediaType.TEXT)
        return None if why is None else unauthorized(why, api=is_api)

    def api(route: str, body: Any, scrub: Scrubber = SHAPES) -> Response:
        """A JSON answer, every string in it scrubbed: secrets by shape, and what ``scrub``
        knows (the tokens and env values of the task and sessions it is about)."""
        body = body if isinstance(body, dict) else {"data": body}
        body = scrub.value({**body, "problems": reader.problems()})
        return Response(body, headers=SECURITY_HEADERS)

    # -- pages ------------------------------------------------------------------------
    @get("/", include_in_schema=False)
    async def overview_page() -> Response:
        return html_page("overview")

    @get("/tasks/{task_id:str}", include_in_schema=False)
    async def task_page(task_id: str) -> Response:
        if not await known_task(task_id):
            return html_page("notfound", 404, what=f"task {task_id}")
        return html_page("task", task=task_id)

    @get("/sessions/{session_id:str}", include_in_schema=False)
    async def session_page(session_id: str) -> Response:
        if session_id not in reader.index.rows:
            return html_page("notfound", 404, what=f"session {session_id}")
        return html_page("session", session=session_id)

    @get("/sessions/{session_id:str}/trajectory", include_in_schema=False)
    async def trajectory_page(session_id: str) -> Response:
        if session_id not in reader.index.rows:
            return html_page("notfound", 404, what=f"session {session_id}")
        return html_page("trajectory", session=session_id)

    @get("/training", include_in_schema=False)
    async def training_page() -> Response:
        return html_page("training")

    @get("/topology", include_in_schema=False)
    async def topology_page() -> Response:
        return html_page("topology")

    async def known_task(task_id: str) -> bool:
        return task_id in reader.index.tasks or await reader.task(task_id) is not None

    # -- the API ----------------------------------------------------------------------
    @get("/api/overview")
    async def api_overview(request: Request) -> Response:
        with API_SECONDS.labels("overview").time():
            try:
                _, offset, limit, _ = parse_query(request.query_params)
            except BadQuery as exc:
                raise HTTPException(status_code=400, detail=str(exc)) from None
            SESSIONS.set(len(reader.index.rows))
            body = views.overview(
                reader.index,
                now=time.time(),
                nodes=reader.nodes,
                streams=reader.streams,
                engines=reader.engines,
                backpressure=reader.backpressure,
                tasks=views.task_page(
                    reader.index, offset, min(limit, 50) if "limit" in request.query_params else 20
                ),
            )
            return api("overview", body)

    @get("/api/sessions")
    async def api_sessions(request: Request) -> Response:
        with API_SECONDS.labels("sessions").time():
            try:
                filters, offset, limit, sort = parse_query(request.query_params)
            except BadQuery as exc:
                raise HTTPException(status_code=400, detail=str(exc)) from None
            page = reader.index.query(filters, offset, limit, sort)
            return api("sessions", {"page": views.sessions_page(page)})

    @get("/api/tasks/{task_id:str}")
    async def api_task(task_id: str) -> Response:
        with API_SECONDS.labels("task").time():
            record = await reader.task(task_id)
            rows = reader.index.task_rows(task_id)
            if record is None and not rows:
                raise not_found(f"no task {task_id!r}")
            spec = record.spec if record else reader.specs.get(task_id)
            trajs = dict(
                zip(
                    [r.session_id for r in rows],
                    await asyncio.gather(
                        *(
                            reader.trajectory(r.session_id, r.attempt, r.state in ENDED)
                            for r in rows[:64]
                        )
                    ),
                    strict=False,
                )
            )
            submitted = record.submitted_at if record else reader.index.submitted.get(task_id, 0)
            body = views.task_view(task_id, spec, rows, trajs, submitted, time.time())
            return api("task", body, reader.secrets(task_id, (r.session_id for r in rows)))

    @get("/api/sessions/{session_id:str}")
    async def api_session(session_id: str) -> Response:
        with API_SECONDS.labels("session").time():
            row = reader.index.rows.get(session_id)
            if row is None:
                raise not_found(f"no session {session_id!r}")
            records, problems = await reader.completions(session_id)
            traj = await reader.trajectory(session_id, row.attempt, row.state in ENDED)
            built = row.state in ENDED or row.state == "EVALUATING"  # its artifacts stored
            art = await reader.run_artifacts(session_id, row.attempt) if built else None
            body = views.session_view(row, records, problems, art, traj, time.time())
            body["lineage"] = lineage = reader.lineage(session_id)  # replays, forks, re-grades
            for replay in lineage["replays"][-LINEAGE_READS:]:  # a diverged one's diff
                replay["diverged"] = await reader.divergence(replay["session_id"])
            return api("session", body, reader.secrets(row.task_id, [session_id]))

    @get("/api/sessions/{session_id:str}/trajectory")
    async def api_trajectory(session_id: str, view: str = "stored") -> Response:
        with API_SECONDS.labels("trajectory").time():
            row = reader.index.rows.get(session_id)
            if row is None:
                raise not_found(f"no session {session_id!r}")
            if view not in trajectory.VIEWS:
                raise HTTPException(
                    status_code=400, detail=f"view must be one of {trajectory.VIEWS}"
                )
            note = None
            if view == "stored":  # what the trainer got; before that, the builder's
                traj = await reader.delivered(row)
                if traj is None:
                    traj = await reader.trajectory(session_id, row.attempt, row.state in ENDED)
                    note = trajectory.undelivered_note(row, traj)
                traces = traj.traces if traj else []
            else:
                records, problems = await reader.completions(session_id)
                outcome = Outcome(row.outcome) if row.outcome else Outcome.COMPLETED
                try:
                    traces = trajectory.rebuild(records, view, outcome)
                except Exception as exc:  # noqa: BLE001 - a builder's failure is shown
                    traces, note = [], f"{view} could not build this session: {exc}"
                if problems:
                    note = "; ".join(problems)
            scrub = reader.secrets(row.task_id, [session_id])
            body = trajectory.trajectory_view(session_id, view, traces, reader.decoder, note, scrub)
            return api("trajectory", body, scrub)

    @get("/api/training")
    async def api_training() -> Response:
        lines = reader.trainer_log()
        if lines is None:
            return api("training", {"configured": False, **training.training_view([])})
        records = training.parse_jsonl(lines)
        body = training.training_view(records, reader.trainer)
        return api("training", {"configured": True, **body})

    @get("/api/topology")
    async def api_topology() -> Response:
        from infra.devstack import healthz

        record = reader.stack_record()
        services = []
        if record is not None:
            checks = await asyncio.gather(
                *(
                    asyncio.to_thread(healthz, p.url)
                    for p in record.procs
                    if p.name not in ("nats", "redis")
                )
            )
            procs = [p for p in record.procs if p.name not in ("nats", "redis")]
            for p, (status, body) in zip(procs, checks, strict=True):
                services.append(
                    {
                        "name": p.name,
                        "url": p.url,
                        "pid": p.pid,
                        "status": status,
                        "ok": status == 200,
                        "detail": body,
                    }
                )
        from importlib.metadata import PackageNotFoundError, version

        try:
            polar_version = version("polar-rollout")
        except PackageNotFoundError:
            polar_version = None
        harnesses = sorted(
            {
                f"{a.harness} {a.harness_version or ''}".strip()
                for a in reader.artifacts.entries.values()
                if a.harness
            }
        )
        return api(
            "topology",
            {
                "polar_version": polar_version,
                "nats_url": _no_password(cfg.nats_url),  # polar up gives it a NATS user
                "redis_url": _no_password(cfg.redis_url),
                "services": services,
                "stack_record": record is not None,
                "nodes": views.node_occupancy(reader.nodes or []),
                "backends": reader.engines,
                "harnesses": harnesses,
            },
        )

    @post("/api/tasks/{task_id:str}/cancel", status_code=200, opt={"admin": True})
    async def api_cancel(task_id: str, request: Request) -> Response:
        if why := refusal(ADMIN, request.headers, admin_token=cfg.admin_token, service="dashboard"):
            CANCELS.labels("refused").inc()
            raise HTTPException(status_code=401, detail=f"{CANCEL_NEEDS}: {why}")
        if not await known_task(task_id):
            raise not_found(f"no task {task_id!r}")
        try:
            message = await reader.cancel(task_id, "cancelled from the dashboard")
        except ConnectionError as exc:
            CANCELS.labels("unreachable").inc()
            raise HTTPException(status_code=503, detail=str(exc)) from None
        CANCELS.labels("sent").inc()
        return api("cancel", {"message": message})

    @get("/api/live")
    async def api_live() -> ServerSentEvent:
        async def changes() -> AsyncIterator[dict[str, Any]]:
            LIVE_CLIENTS.inc()
            try:
                seen, seen_log, seen_problems, quiet = -1, None, None, 0.0
                while True:
                    v, log = reader.index.version, reader.trainer_log_stamp()
                    problems = reader.problems()
                    # a banner comes and goes with its problem, not at the next heartbeat
                    if v != seen or log != seen_log or problems != seen_problems or quiet >= 15.0:
                        seen, seen_log, seen_problems, quiet = v, log, problems, 0.0
                        yield {
                            "event": "change",
                            "data": _json(
                                SHAPES.value(
                                    {
                                        "version": v,
                                        "trainer_log": log,  # the training page follows it
                                        "ts": time.time(),
                                        "states": reader.index.state_counts(),
                                        "problems": problems,
                                    }
                                )
                            ),
                        }
                    await asyncio.sleep(cfg.refresh_seconds)
                    quiet += cfg.refresh_seconds
            finally:
                LIVE_CLIENTS.dec()

        return ServerSentEvent(changes(), headers={"Cache-Control": "no-store"})

    ops = ops_routes("dashboard", health)
    for handler in ops:  # /healthz and /metrics: open, as on every service
        handler.opt["open"] = True
    return Litestar(
        route_handlers=[
            *ops,
            overview_page,
            task_page,
            session_page,
            trajectory_page,
            training_page,
            topology_page,
            api_overview,
            api_sessions,
            api_task,
            api_session,
            api_trajectory,
            api_training,
            api_topology,
            api_cancel,
            api_live,
            create_static_files_router(  # no data: what a sign-in page needs
                path="/static",
                directories=[str(STATIC)],
                include_in_schema=False,
                opt={"open": True},
            ),
        ],
        before_request=gate,
        lifespan=[lifespan],
        logging_config=service_logging(),
        openapi_config=None,
    )


def _json(body: dict[str, Any]) -> str:
    import orjson

    return orjson.dumps(body).decode()


def _no_password(url: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}:{parts.port}"
        return urlunsplit(parts._replace(netloc=netloc))
    return url
