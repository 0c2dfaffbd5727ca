"""Serving an ASGI app (litestar) through granian's RSGI interface.

RSGI hands a request to Python as a scope object and a protocol whose body read and
response are single calls into granian's Rust side, where ASGI passes a dict message
for each step: a request answered over RSGI costs ~35 µs less (measured on these
machines with one granian worker, 145 vs 185 µs a round trip for the same small
answer). An app that answers its hot routes natively (``proxy.io.serving``) serves the
rest through ``serve_asgi``, and runs the ASGI lifespan from RSGI's init and del hooks
with ``Lifespan``. Only HTTP: none of Polar's services serves websockets.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from granian.rsgi import ProtocolClosed, ProtocolError

log = logging.getLogger("polar.rsgi")

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Any]
CLOSED = (ProtocolClosed, ProtocolError)  # what granian raises once the client is gone


def _address(value: str) -> tuple[str, int] | None:
    host, _, port = value.rpartition(":")
    return (host, int(port)) if port.isdigit() else None


def asgi_scope(scope: Any, state: dict) -> dict:
    """The ASGI ``http`` scope of an RSGI request."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": scope.http_version,
        "method": scope.method,
        "scheme": scope.scheme,
        "path": scope.path,
        "raw_path": scope.path.encode(),
        "root_path": "",
        "query_string": scope.query_string.encode("latin-1"),
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in scope.headers.items()],
        "client": _address(scope.client),
        "server": _address(scope.server),
        "state": dict(state),
    }


async def serve_asgi(app: ASGIApp, scope: Any, proto: Any, state: dict) -> None:
    """Answer one RSGI request with an ASGI app: its whole body as one ``http.request``
    message, then ``http.disconnect`` once the client goes; its answer as one RSGI
    response, or a stream when it sends its body in parts."""
    read = False

    async def receive() -> dict:
        nonlocal read
        if not read:
            read = True
            try:
                body = await proto()
            except CLOSED:
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": body, "more_body": False}
        await proto.client_disconnect()
        return {"type": "http.disconnect"}

    start: dict | None = None
    stream: Any = None

    async def send(message: dict) -> None:
        nonlocal start, stream
        kind = message["type"]
        if kind == "http.response.start":
            start = message
            return
        if kind != "http.response.body" or start is None:
            return
        body, more = message.get("body", b""), message.get("more_body", False)
        if stream is None:
            status = start["status"]
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in start["headers"]]
            if not more:
                proto.response_bytes(status, headers, body)
                return
            stream = proto.response_stream(status, headers)
        if body:
            try:
                await stream.send_bytes(body)
            except CLOSED as e:  # as ASGI servers do for a client that left
                raise OSError("client disconnected") from e

    await app(asgi_scope(scope, state), receive, send)
    if start is None:  # the app answered nothing: the server must still answer
        proto.response_empty(500, [])


class Lifespan:
    """An ASGI app's lifespan, driven from RSGI's ``__rsgi_init__`` and ``__rsgi_del__``
    (both run before and after the server's loop, so each runs the loop itself). A
    startup that fails ends the worker process, as granian does for ASGI apps."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.state: dict = {}  # what the app keeps in its lifespan state, copied per request
        self._inbox: asyncio.Queue[dict] | None = None
        self._task: asyncio.Task | None = None
        self._replies: dict[str, asyncio.Future] = {}

    def startup(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.run_until_complete(self._start())
        except Exception as exc:
            # Straight to stderr: litestar's logging goes through a queue whose thread
            # dies unflushed with the worker, so a logged error would never be seen.
            sys.stderr.write(startup_failure(exc))
            sys.stderr.flush()
            sys.exit(1)

    def shutdown(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is None or self._task.done():
            return
        try:
            loop.run_until_complete(self._step("shutdown"))
        except Exception:
            log.exception("lifespan shutdown failed")

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._inbox = asyncio.Queue()
        self._replies = {step: loop.create_future() for step in ("startup", "shutdown")}
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": self.state}
        self._task = loop.create_task(self.app(scope, self._inbox.get, self._send))
        self._task.add_done_callback(_retrieve)  # a failure is reported by _step
        await self._step("startup")

    async def _step(self, step: str) -> None:
        assert self._inbox is not None and self._task is not None
        self._inbox.put_nowait({"type": f"lifespan.{step}"})
        reply = self._replies[step]
        await asyncio.wait({reply, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if reply.done():
            reply.result()  # raises what the app reported as failed
        elif self._task.exception() is not None:
            raise RuntimeError(f"lifespan {step} failed") from self._task.exception()
        else:
            raise RuntimeError(f"the app ended its lifespan before {step} completed")

    async def _send(self, message: dict) -> None:
        step, _, outcome = message["type"].removeprefix("lifespan.").partition(".")
        reply = self._replies.get(step)
        if reply is None or reply.done():
            return
        if outcome == "complete":
            reply.set_result(None)
        else:
            reply.set_exception(RuntimeError(message.get("message") or f"{step} failed"))


def startup_failure(exc: BaseException) -> str:
    """The text a failed start-up leaves in the service's log: the app's own traceback
    (litestar reports the lifespan's as the failure message), else this one's."""
    cause = exc.__cause__ or exc
    text = str(exc) if "Traceback (most recent call last)" in str(exc) else ""
    if not text:
        text = "".join(traceback.format_exception(cause))
    return f"lifespan startup failed:\n{text.rstrip()}\n"


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
