"""The hot path: the protocols' POST routes served straight from the server, around litestar.

Every model call is a POST to one of a handful of fixed paths. Litestar's routing,
request and response layers cost more per call than the proxy's own work, so
``ProxyApp`` answers those paths itself (same ``_Proxy.serve`` logic, same replies) and
hands everything else (ops, admin, probes, unknown paths, lifespan) to litestar.

It speaks both server interfaces: RSGI, as ``polar serve proxy`` runs it (granian: a
request's body is one call and its answer another, ~35 µs less per call than ASGI's
messages; litestar's routes through ``proxy.io.rsgi``), and ASGI (litestar's
test client, any ASGI server). ``AsgiRequest`` and ``RsgiRequest`` give the routes the
same few operations: read the body under a limit, wait for a disconnect, stream, answer.
What a route may rely on is typed once: ``RequestHead`` (path params, headers, query),
which these two and litestar's ``Request`` (the protocols' GET routes) all offer, and
``CallRequest``, the head plus those operations, which only the hot routes' requests have.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable
from urllib.parse import parse_qsl

from litestar import Litestar

from proxy.io.rsgi import CLOSED, Lifespan, serve_asgi

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
    """What every request a protocol route gets offers: ``AsgiRequest``, ``RsgiRequest``
    and litestar's ``Request`` (the protocols' GET routes, served by litestar)."""

    @property
    def path_params(self) -> Mapping[str, Any]: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def query_params(self) -> Mapping[str, str]: ...


@runtime_checkable
class CallRequest(RequestHead, Protocol):
    """A hot route's request (``AsgiRequest``, ``RsgiRequest``): its head, and its body
    read under a limit, a wait for a disconnect, a stream of keep-alives, the answer.
    ``started``: the stream has begun (the answer then only ends it)."""

    started: bool

    async def read(self, limit: int) -> bytes: ...

    async def disconnected(self) -> None: ...

    async def start_stream(self) -> None: ...

    async def send_chunk(self, data: bytes) -> None: ...

    async def finish(self, reply: Reply) -> None: ...


class BodyTooLarge(Exception):
    """The request body is over the limit (left unread past it)."""


class ClientGone(Exception):
    """The client disconnected."""


SSE_START = [("content-type", SSE), *SSE_HEADERS.items()]


def _query(qs: str) -> dict[str, str]:
    return dict(parse_qsl(qs)) if qs else {}


class AsgiRequest:
    """A hot-path request from an ASGI server. ``started``: its stream of keep-alives
    has begun (the reply then only ends it)."""

    __slots__ = ("path_params", "headers", "started", "_scope", "_receive", "_send", "_query")

    def __init__(self, scope: dict, receive: Callable, send: Callable) -> None:
        self._scope, self._receive, self._send = scope, receive, send
        self.path_params: dict[str, str] = {}
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.started = False
        self._query: dict[str, str] | None = None

    @property
    def query_params(self) -> dict[str, str]:
        if self._query is None:
            self._query = _query(self._scope.get("query_string", b"").decode("latin-1"))
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


class RsgiRequest:
    """A hot-path request from granian's RSGI interface."""

    __slots__ = ("path_params", "headers", "started", "_scope", "_proto", "_stream", "_query")

    def __init__(self, scope: Any, proto: Any) -> None:
        self._scope, self._proto = scope, proto
        self.path_params: dict[str, str] = {}
        self.headers = scope.headers  # a mapping with .get; names are lower-case
        self.started = False
        self._stream: Any = None
        self._query: dict[str, str] | None = None

    @property
    def query_params(self) -> dict[str, str]:
        if self._query is None:
            self._query = _query(self._scope.query_string)
        return self._query

    async def read(self, limit: int) -> bytes:
        declared = self.headers.get("content-length", "")
        try:
            if declared.isdigit():  # the server reads exactly that many bytes
                if int(declared) > limit:
                    raise BodyTooLarge
                return await self._proto()
            chunks: list[bytes] = []  # chunked: counted as it comes
            size = 0
            async for chunk in self._proto:
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge
                chunks.append(chunk)
            return b"".join(chunks)
        except CLOSED as e:
            raise ClientGone from e

    async def disconnected(self) -> None:
        await self._proto.client_disconnect()

    async def start_stream(self) -> None:
        self._stream = self._proto.response_stream(200, SSE_START)
        self.started = True

    async def send_chunk(self, data: bytes) -> None:
        try:
            await self._stream.send_bytes(data)
        except CLOSED as e:
            raise ClientGone from e

    async def finish(self, reply: Reply) -> None:
        if self.started:
            if reply.media_type == SSE and reply.body:
                with contextlib.suppress(*CLOSED):  # the client left just now
                    await self._stream.send_bytes(reply.body)
            return
        with contextlib.suppress(*CLOSED):
            self._proto.response_bytes(reply.status, _headers(reply), reply.body)


def _headers(reply: Reply) -> list[tuple[str, str]]:
    return [("content-type", reply.media_type), *reply.headers.items()]


Serve = Callable[[Any, Any, CallRequest], Awaitable[Reply]]


class HotRoutes:
    """POST routes of the protocols: fixed paths, or a prefix and one ``{name:path}``
    tail; each at the root and under ``/s/{token}``. Another method on a fixed path gets
    ``wrong_method`` (litestar only knows the protocols' GET routes)."""

    def __init__(self, serve: Serve, protocols: Sequence[Any], wrong_method: Reply) -> None:
        self.serve, self.wrong_method = serve, wrong_method
        self.exact: dict[str, tuple[Any, Any]] = {}
        self.tails: list[tuple[str, str, Any, Any]] = []
        for spec in protocols:
            for r in spec.routes:
                if r.method != "POST":
                    continue
                if "{" not in r.path:
                    self.exact[r.path] = (spec, r)
                elif r.path.endswith(":path}") and r.path.count("{") == 1:
                    prefix, _, name = r.path[:-6].partition("{")
                    self.tails.append((prefix, name, spec, r))

    def match(self, method: str, path: str) -> tuple[Any, Any, dict[str, str]] | Reply | None:
        params: dict[str, str] = {}
        if path.startswith("/s/"):
            token, slash, rest = path[3:].partition("/")
            if not token or not slash:
                return None
            params["token"], path = token, "/" + rest
        hit = self.exact.get(path)
        if method != "POST":
            return self.wrong_method if hit is not None else None
        if hit is not None:
            return hit[0], hit[1], params
        for prefix, name, spec, r in self.tails:
            if path.startswith(prefix) and len(path) > len(prefix):
                params[name] = path[len(prefix) :]
                return spec, r, params
        return None


_AFTER_REPLY: ContextVar[list | None] = ContextVar("polar_after_reply", default=None)


def after_reply(fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(*args)`` once this request's answer is with the server: work the answer
    need not wait for. Outside a hot-path request: on the event loop's next turn."""
    pending = _AFTER_REPLY.get()
    if pending is None:
        asyncio.get_running_loop().call_soon(fn, *args)
    else:
        pending.append((fn, args))


class ProxyApp(Litestar):
    """Litestar, with the hot routes answered before its router sees them; served over
    ASGI (``__call__``) or RSGI (``__rsgi__`` and its init/del hooks)."""

    hot: HotRoutes | None = None
    _lifespan: Lifespan | None = None

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        if scope["type"] == "http" and self.hot is not None:
            hit = self.hot.match(scope["method"], scope["path"])
            if hit is not None:
                await self._answer(hit, AsgiRequest(scope, receive, send))
                return
        await super().__call__(scope, receive, send)

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        hit = self.hot.match(scope.method, scope.path) if self.hot is not None else None
        if hit is not None:
            await self._answer(hit, RsgiRequest(scope, proto))
            return
        state = self._lifespan.state if self._lifespan is not None else {}
        await serve_asgi(super().__call__, scope, proto, state)

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._lifespan = Lifespan(super().__call__)
        self._lifespan.startup(loop)

    def __rsgi_del__(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._lifespan is not None:
            self._lifespan.shutdown(loop)

    async def _answer(
        self, hit: tuple[Any, Any, dict[str, str]] | Reply, request: CallRequest
    ) -> None:
        if isinstance(hit, Reply):
            await request.finish(hit)
            return
        assert self.hot is not None
        spec, route, request.path_params = hit
        pending: list = []
        context = _AFTER_REPLY.set(pending)
        try:
            await request.finish(await self.hot.serve(spec, route, request))
        finally:
            _AFTER_REPLY.reset(context)
            _run(pending)


def _run(pending: list) -> None:
    for fn, args in pending:
        try:
            fn(*args)
        except Exception:
            log.exception("after-reply work failed")
