"""The hot path: protocol POST routes served straight from ASGI, around litestar.

Every model call is a POST to one of a handful of fixed paths. Litestar's routing,
request and response layers cost more per call than the proxy's own work, so
``ProxyApp`` answers those paths itself (same ``_Proxy.serve`` logic, same replies) and
hands everything else (ops, admin, probes, unknown paths, lifespan) to litestar.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from litestar import Litestar

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


SSE_START = [(b"content-type", SSE.encode())] + [
    (k.encode(), v.encode()) for k, v in SSE_HEADERS.items()
]


class RawRequest:
    """The parts of a request the proxy reads, straight from the ASGI scope, and the
    ASGI ``send`` for a stream that has to start before its answer is there
    (``started`` then: the reply only ends it)."""

    __slots__ = ("path_params", "headers", "receive", "send", "started", "_scope", "_query")

    def __init__(
        self, scope: dict, receive: Callable, send: Callable, path_params: dict[str, str]
    ) -> None:
        self._scope, self.receive, self.send, self.path_params = scope, receive, send, path_params
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.started = False
        self._query: dict[str, str] | None = None

    @property
    def query_params(self) -> dict[str, str]:
        if self._query is None:
            qs = self._scope.get("query_string", b"")
            self._query = dict(parse_qsl(qs.decode("latin-1"))) if qs else {}
        return self._query


Serve = Callable[[Any, Any, Any], Awaitable[Reply]]


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
    """Litestar, with the hot routes answered before its router sees them."""

    hot: HotRoutes | None = None

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        if scope["type"] == "http" and self.hot is not None:
            hit = self.hot.match(scope["method"], scope["path"])
            if isinstance(hit, Reply):
                await send_reply(hit, send)
                return
            if hit is not None:
                spec, route, params = hit
                request = RawRequest(scope, receive, send, params)
                pending: list = []
                context = _AFTER_REPLY.set(pending)
                try:
                    reply = await self.hot.serve(spec, route, request)
                    if request.started:  # a stream of keep-alives: the reply ends it
                        await _end_stream(reply, send)
                    else:
                        await send_reply(reply, send)
                finally:
                    _AFTER_REPLY.reset(context)
                    _run(pending)
                return
        await super().__call__(scope, receive, send)


def _run(pending: list) -> None:
    for fn, args in pending:
        try:
            fn(*args)
        except Exception:
            log.exception("after-reply work failed")


async def send_reply(reply: Reply, send: Callable) -> None:
    headers = [(b"content-type", reply.media_type.encode())]
    headers += [(k.encode(), v.encode()) for k, v in reply.headers.items()]
    headers.append((b"content-length", str(len(reply.body)).encode()))
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


async def _end_stream(reply: Reply, send: Callable) -> None:
    body = reply.body if reply.media_type == SSE else b""  # a 499: the client is gone
    # a client that left just now: ASGI servers raise an OSError from send then
    with contextlib.suppress(OSError):
        await send({"type": "http.response.body", "body": body, "more_body": False})
