"""The hot path: protocol POST routes served straight from ASGI, around litestar.

Every model call is a POST to one of a handful of fixed paths. Litestar's routing,
request and response layers cost more per call than the proxy's own work, so
``ProxyApp`` answers those paths itself (same ``_Proxy.serve`` logic, same replies) and
hands everything else (ops, admin, probes, unknown paths, lifespan) to litestar.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from litestar import Litestar

JSON = "application/json"
SSE = "text/event-stream"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


@dataclass(slots=True)
class Reply:
    """What a route answers, independent of the server layer that sends it."""

    status: int
    body: bytes = b""
    media_type: str = JSON
    stream: AsyncIterator[bytes] | None = None  # frames, when the answer is not there yet

    @property
    def headers(self) -> dict[str, str]:
        return SSE_HEADERS if self.media_type == SSE else {}


class RawRequest:
    """The parts of a request the proxy reads, straight from the ASGI scope."""

    __slots__ = ("path_params", "headers", "receive", "_scope", "_query")

    def __init__(self, scope: dict, receive: Callable, path_params: dict[str, str]) -> None:
        self._scope, self.receive, self.path_params = scope, receive, path_params
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
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
    tail; each at the root and under ``/s/{token}``."""

    def __init__(self, serve: Serve, protocols: Sequence[Any]) -> None:
        self.serve = serve
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

    def match(self, method: str, path: str) -> tuple[Any, Any, dict[str, str]] | None:
        if method != "POST":
            return None
        params: dict[str, str] = {}
        if path.startswith("/s/"):
            token, slash, rest = path[3:].partition("/")
            if not token or not slash:
                return None
            params["token"], path = token, "/" + rest
        hit = self.exact.get(path)
        if hit is not None:
            return hit[0], hit[1], params
        for prefix, name, spec, r in self.tails:
            if path.startswith(prefix) and len(path) > len(prefix):
                params[name] = path[len(prefix) :]
                return spec, r, params
        return None


class ProxyApp(Litestar):
    """Litestar, with the hot routes answered before its router sees them."""

    hot: HotRoutes | None = None

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        if scope["type"] == "http" and self.hot is not None:
            hit = self.hot.match(scope["method"], scope["path"])
            if hit is not None:
                spec, route, params = hit
                reply = await self.hot.serve(spec, route, RawRequest(scope, receive, params))
                await send_reply(reply, receive, send)
                return
        await super().__call__(scope, receive, send)


async def send_reply(reply: Reply, receive: Callable, send: Callable) -> None:
    headers = [(b"content-type", reply.media_type.encode())]
    headers += [(k.encode(), v.encode()) for k, v in reply.headers.items()]
    if reply.stream is None:
        headers.append((b"content-length", str(len(reply.body)).encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": reply.body})
        return
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await _stream(reply.stream, receive, send)


async def _stream(frames: AsyncIterator[bytes], receive: Callable, send: Callable) -> None:
    """Send frames until they end or the client leaves (which cancels the sender, and
    with it whatever the frames were waiting for)."""

    async def pump() -> None:
        async for chunk in frames:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    sender = asyncio.ensure_future(pump())
    listener = asyncio.ensure_future(disconnected(receive))
    try:
        await asyncio.wait({sender, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = listener.done()
        listener.cancel()
        if not sender.done():
            sender.cancel()
            await asyncio.wait({sender})
    if not gone and not sender.cancelled():
        sender.result()  # a failure while the client is still there is a real error


async def disconnected(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
