"""The proxy's HTTP surface served straight from the server: one router, no framework.

Every model call is a POST to one of a handful of fixed paths. A web framework's routing,
request and response layers cost more per call than the proxy's own work, so
``ProxyApp`` answers every request itself: ``ProxyRoutes`` is its one router, for the
harnesses' routes (every protocol route, GET and POST, and the probes) and the
operator's (health, metrics, admin: ``OperatorRoute``), and it runs the lifespan.

It is served two ways: by ``proxy.io.native`` (HTTP/1.1 on the proxy's own event loop,
as ``polar serve proxy`` runs it: no server threads between the socket and the app),
and over ASGI (``__call__``: litestar's test client, any ASGI server). Their requests,
``NativeRequest`` and ``AsgiRequest``, give the routes the same few operations: read
the body under a limit, wait for a disconnect, stream, answer. What a route may rely
on is typed once:
``RequestHead`` (path params, headers, query), all a route that reads no body uses, and
``CallRequest``, the head plus those operations; both request classes are both, and
they are the only requests any route receives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable
from urllib.parse import parse_qsl

from proxy.io.limits import HttpLimits

log = logging.getLogger("polar.proxy")

JSON = "application/json"
SSE = "text/event-stream"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
CLOSE = {"connection": "close"}


@dataclass(slots=True)
class Reply:
    """What a route answers, independent of the server layer that sends it."""

    status: int
    body: bytes = b""
    media_type: str = JSON
    close: bool = False  # end the connection after it (the request body was left unread)

    @property
    def headers(self) -> dict[str, str]:
        if self.close:
            return CLOSE
        return SSE_HEADERS if self.media_type == SSE else {}


@runtime_checkable
class RequestHead(Protocol):
    """What a protocol route that reads no body (a models list) relies on; ``NativeRequest``
    and ``AsgiRequest`` offer it."""

    @property
    def path_params(self) -> Mapping[str, Any]: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def query_params(self) -> Mapping[str, str]: ...


@runtime_checkable
class CallRequest(RequestHead, Protocol):
    """A protocol route's request (``NativeRequest``, ``AsgiRequest``): its head, and its
    body read under a limit, a wait for a disconnect, a stream of keep-alives, the answer.
    ``started``: the stream has begun (the answer then only ends it). ``loop``: the event
    loop it is served on (asking asyncio for the running loop costs a ``getpid()``
    syscall per ask on Python 3.11, several per call on the hot path)."""

    started: bool

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    async def read(self, limit: int) -> bytes: ...

    async def disconnected(self) -> None: ...

    def watch_gone(self, callback: Callable[[], None] | None) -> bool:
        """Have ``callback`` called once if the client leaves while this request is
        answered (None: no longer); False: this server cannot, wait on ``disconnected``."""
        ...

    async def start_stream(self) -> None: ...

    async def send_chunk(self, data: bytes) -> None: ...

    async def finish(self, reply: Reply) -> None: ...


class BodyTooLarge(Exception):
    """The request body is over the limit (left unread past it)."""


class ClientGone(Exception):
    """The client disconnected."""


SSE_START = [("content-type", SSE), *SSE_HEADERS.items()]


def parse_query(qs: str) -> dict[str, str]:
    return dict(parse_qsl(qs)) if qs else {}


class AsgiRequest:
    """A hot-path request from an ASGI server. ``started``: its stream of keep-alives
    has begun (the reply then only ends it)."""

    __slots__ = (
        "path_params", "headers", "started", "loop", "_scope", "_receive", "_send", "_query",
    )  # fmt: skip

    def __init__(self, scope: dict, receive: Callable, send: Callable) -> None:
        self._scope, self._receive, self._send = scope, receive, send
        self.loop = asyncio.get_running_loop()  # made by the server, in its loop
        self.path_params: dict[str, str] = {}
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.started = False
        self._query: dict[str, str] | None = None

    @property
    def query_params(self) -> dict[str, str]:
        if self._query is None:
            self._query = parse_query(self._scope.get("query_string", b"").decode("latin-1"))
        return self._query

    async def read(self, limit: int) -> bytes:
        declared = self.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                raise BodyTooLarge
            chunks.append(body)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def disconnected(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass

    def watch_gone(self, callback: Callable[[], None] | None) -> bool:
        return False  # ASGI says so only to a task waiting in receive()

    async def start_stream(self) -> None:
        headers = [(k.encode(), v.encode()) for k, v in SSE_START]
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})
        self.started = True

    async def send_chunk(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, reply: Reply) -> None:
        if self.started:  # a stream of keep-alives: the reply ends it
            body = reply.body if reply.media_type == SSE else b""  # a 499: the client is gone
            # a client that left just now: ASGI servers raise an OSError from send then
            with contextlib.suppress(OSError):
                await self._send({"type": "http.response.body", "body": body, "more_body": False})
            return
        headers = [(k.encode(), v.encode()) for k, v in _headers(reply)]
        headers.append((b"content-length", str(len(reply.body)).encode()))
        await self._send(
            {"type": "http.response.start", "status": reply.status, "headers": headers}
        )
        await self._send({"type": "http.response.body", "body": reply.body})


def _headers(reply: Reply) -> list[tuple[str, str]]:
    return [("content-type", reply.media_type), *reply.headers.items()]


Serve = Callable[[Any, Any, CallRequest], Awaitable[Reply]]  # (protocol, route, request)
Answer = Callable[[CallRequest], Awaitable[Reply]]


@dataclass(frozen=True, slots=True)
class OperatorRoute:
    """A route of the operator's surface (health, metrics, admin), at the root only:
    ``answer`` gets the request as it came (headers, body) and makes the whole reply."""

    method: str
    path: str
    answer: Answer


class _Table:
    """One method's routes: fixed paths, or a prefix and one ``{name:path}`` tail."""

    def __init__(self) -> None:
        self.exact: dict[str, tuple[Any, Any]] = {}
        self.tails: list[tuple[str, str, Any, Any]] = []

    def add(self, spec: Any, r: Any) -> None:
        if "{" not in r.path:
            self.exact[r.path] = (spec, r)
        elif r.path.endswith(":path}") and r.path.count("{") == 1:
            prefix, _, name = r.path[:-6].partition("{")
            self.tails.append((prefix, name, spec, r))
        else:
            raise ValueError(f"route {r.method} {r.path}: a fixed path or one {{name:path}} tail")

    def match(self, path: str, params: dict[str, str]) -> tuple[Any, Any] | None:
        hit = self.exact.get(path)
        if hit is not None:
            return hit
        for prefix, name, spec, r in self.tails:
            if path.startswith(prefix) and len(path) > len(prefix):
                params[name] = path[len(prefix) :]
                return spec, r
        return None


@dataclass(frozen=True, slots=True)
class Served:
    """How each kind of route is answered: a model call (``call``, a ``CallRequest``), a
    protocol route that reads no body (``head``), an operator's route (``operator``,
    given its ``OperatorRoute``); the fixed replies: a known path asked with another
    method, an unknown path, the probes; ``refused``: the reply to a request the server
    could not parse (status, reason)."""

    call: Serve
    head: Serve
    operator: Serve
    wrong_method: Reply
    not_found: Reply
    probe: Reply
    refused: Callable[[int, str], Reply]


class ProxyRoutes:
    """The one router of the proxy's HTTP surface. The harnesses': every route of every
    protocol (model calls, token counts, model lists) and the probes some CLIs send
    first, each at the root and under ``/s/{token}``; model calls (POST) are looked up
    first. The operator's (health, metrics, admin): at the root, a trailing slash
    ignored. ``match`` answers every request: a route to serve, or a fixed ``Reply``.
    """

    def __init__(
        self,
        served: Served,
        protocols: Sequence[Any],
        operator: Sequence[OperatorRoute] = (),
        probes: Sequence[str] = (),
    ) -> None:
        self.served = served
        self.tables: dict[str, _Table] = {}
        for spec in protocols:
            for r in spec.routes:
                self.tables.setdefault(r.method, _Table()).add(spec, r)
        self.post = self.tables.get("POST", _Table())  # model calls: looked up first
        self.operator: dict[tuple[str, str], OperatorRoute] = {}
        for route in operator:
            key = (route.method, route.path)
            if key in self.operator or self._protocol_path(route.path) is not None:
                raise ValueError(f"route {route.method} {route.path}: already routed")
            self.operator[key] = route
        self.operator_paths = frozenset(path for _, path in self.operator)
        self.probes = frozenset(probes)

    def match(self, method: str, path: str) -> tuple[Serve, Any, Any, dict[str, str]] | Reply:
        params: dict[str, str] = {}
        if path.startswith("/s/"):
            token, slash, rest = path[3:].partition("/")
            if not token or not slash:
                return self.served.not_found
            params["token"], path = token, "/" + rest
        if method == "POST":
            hit = self.post.match(path, params)
            if hit is not None:
                return self.served.call, hit[0], hit[1], params
        else:
            table = self.tables.get(method)
            hit = table.match(path, params) if table is not None else None
            if hit is not None:
                return self.served.head, hit[0], hit[1], params
            if method == "HEAD" and path in self.probes:
                return self.served.probe
        if "token" not in params:  # the operator's routes are not a session's
            plain = path.rstrip("/") or "/"
            route = self.operator.get((method, plain))
            if route is not None:
                return self.served.operator, None, route, params
            if plain in self.operator_paths:
                return self.served.wrong_method
        known = any(t.match(path, {}) for m, t in self.tables.items() if m != method)
        return self.served.wrong_method if known else self.served.not_found

    def is_probe(self, method: str, path: str) -> bool:
        """An operator's route that reads (``GET /healthz``, ``/metrics``): what a
        connection past the server's connection cap is still answered."""
        plain = path.rstrip("/") or "/"
        return method in ("GET", "HEAD") and (method, plain) in self.operator

    def _protocol_path(self, path: str) -> str | None:
        return next((m for m, t in self.tables.items() if t.match(path, {})), None)


class _Answering:
    """The request a task is answering (its context's): what to run once the answer is
    out, and the loop it is served on."""

    __slots__ = ("pending", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.pending: list[tuple[Callable[..., None], tuple]] = []
        self.loop = loop


_ANSWERING: ContextVar[_Answering | None] = ContextVar("polar_answering", default=None)


def after_reply(fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(*args)`` once this request's answer is with the server: work the answer
    need not wait for. Outside a hot-path request: on the event loop's next turn."""
    answering = _ANSWERING.get()
    if answering is None:
        asyncio.get_running_loop().call_soon(fn, *args)
    else:
        answering.pending.append((fn, args))


def serving_loop() -> asyncio.AbstractEventLoop:
    """The event loop this request is answered on, known without asking asyncio: on
    Python 3.11 each ``asyncio.get_running_loop()`` is a ``getpid()`` syscall, ~2% of
    the proxy's CPU per call where the handler asked once. Outside a request: asyncio's."""
    answering = _ANSWERING.get()
    return asyncio.get_running_loop() if answering is None else answering.loop


Lifespan = Callable[[Any], AbstractAsyncContextManager[Any]]


class ProxyApp:
    """The proxy's server app: every request routed by ``ProxyRoutes`` and answered here,
    from ``proxy.io.native`` (``answer``, as ``polar serve proxy`` runs it) or over ASGI
    (``__call__``: litestar's test client, any ASGI server). ``lifespan``: context
    managers, each given the app, entered in order at start-up and left in reverse at
    shutdown, from the native server's start and stop or ASGI's lifespan messages.
    ``http_limits``: the native server's bounds (timeouts, connection caps)."""

    def __init__(
        self,
        routes: ProxyRoutes,
        lifespan: Sequence[Lifespan] = (),
        http_limits: HttpLimits | None = None,
    ) -> None:
        self.routes = routes
        self.lifespan = tuple(lifespan)
        self.http_limits = http_limits or HttpLimits()
        self._running: AsyncExitStack | None = None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        kind = scope["type"]
        if kind == "http":
            hit = self.routes.match(scope["method"], scope["path"])
            await self._answer(hit, AsgiRequest(scope, receive, send))
        elif kind == "lifespan":
            await self._asgi_lifespan(receive, send)
        else:  # websockets: none of the proxy's routes is one
            await send({"type": "websocket.close", "code": 1000})

    async def answer(self, method: str, path: str, request: CallRequest) -> None:
        """Route and answer one request of a server that makes its own request objects
        (``proxy.io.native``)."""
        await self._answer(self.routes.match(method, path), request)

    async def startup(self) -> None:
        running = AsyncExitStack()
        try:
            for lifespan in self.lifespan:
                await running.enter_async_context(lifespan(self))
        except BaseException:
            await running.aclose()  # what did start is stopped again
            raise
        self._running = running

    async def shutdown(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            await running.aclose()

    async def _asgi_lifespan(self, receive: Callable, send: Callable) -> None:
        for step in ("startup", "shutdown"):
            await receive()  # the server's lifespan.<step>
            try:
                await (self.startup() if step == "startup" else self.shutdown())
            except Exception:
                message = traceback.format_exc()
                await send({"type": f"lifespan.{step}.failed", "message": message})
                return
            await send({"type": f"lifespan.{step}.complete"})

    async def _answer(
        self, hit: tuple[Serve, Any, Any, dict[str, str]] | Reply, request: CallRequest
    ) -> None:
        if isinstance(hit, Reply):
            await request.finish(hit)
            return
        serve, spec, route, request.path_params = hit
        answering = _Answering(request.loop)
        context = _ANSWERING.set(answering)
        try:
            await request.finish(await serve(spec, route, request))
        finally:
            _ANSWERING.reset(context)
            _run(answering.pending)


def _run(pending: list) -> None:
    for fn, args in pending:
        try:
            fn(*args)
        except Exception:
            log.exception("after-reply work failed")
