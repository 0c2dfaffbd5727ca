"""HTTP/1.1 served on the proxy's own event loop: no server threads between a harness
and the app.

Under granian a request crosses from its Rust I/O thread to the Python loop and its
answer crosses back, each hand-off a wake-up of the other side and a trip through the
GIL; on these 2-core VMs that was ~35-41% of the proxy's CPU per call (py-spy), more
than the app's own Python. Here the loop (uvloop) reads the socket, httptools (llhttp,
Node's parser, in C) parses the head, and the app's task runs in the same turn: one
thread, no hand-off. ``serve_native`` runs a ``ProxyApp``; ``NativeRequest`` is its
``CallRequest``.

HTTP/1.1 as the harnesses' clients speak it: keep-alive (HTTP/1.0 only when asked),
pipelined requests answered in order, chunked or sized request bodies read under the
app's limit (a body past it is left unread and the connection closed after the answer),
``Expect: 100-continue`` answered when the app reads the body, streams sent chunked,
back-pressure from a slow reader, a client that leaves seen at once, a request that asks
to switch protocols (h2c, websocket) answered over HTTP/1.1 all the same. Bounds: a request
head over ``MAX_HEAD_BYTES`` is a 431, a head not complete within ``HEAD_TIMEOUT_S`` of
its first byte closes the connection, an idle keep-alive connection is closed after
``IDLE_TIMEOUT_S``. Malformed requests get a 400 in the generic error body and the
connection is closed. SIGTERM or SIGINT: stop listening, let the calls under way finish
(up to ``DRAIN_TIMEOUT_S``), close, run the app's shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import importlib
import logging
import signal
import socket
import sys
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import httptools

from proxy.io.serving import (
    SSE,
    SSE_START,
    BodyTooLarge,
    ClientGone,
    ProxyApp,
    Reply,
    parse_query,
)

log = logging.getLogger("polar.proxy")

MAX_HEAD_BYTES = 64 * 1024  # request line and headers
HEAD_TIMEOUT_S = 30.0  # from a request's first byte to the end of its head
IDLE_TIMEOUT_S = 300.0  # a kept-alive connection with no request under way
DRAIN_TIMEOUT_S = 30.0  # at shutdown, for the calls under way
UNREAD_BUFFER_BYTES = 256 * 1024  # body held before the app asks for it; then reading pauses

_PHRASES = {s.value: s.phrase for s in http.HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_STREAM_HEAD = b"HTTP/1.1 200 OK\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in SSE_START)


def _status_line(status: int) -> bytes:
    return f"HTTP/1.1 {status} {_PHRASES.get(status, 'Unknown')}\r\n".encode()


_STATUS_LINES = {s: _status_line(s) for s in _PHRASES}


def _head(status: int, media_type: str, length: int) -> bytes:
    """A sized answer's first lines; the caller adds its other headers and the blank line."""
    status_line = _STATUS_LINES.get(status) or _status_line(status)
    return b"%bcontent-type: %b\r\ncontent-length: %d\r\n" % (
        status_line,
        media_type.encode(),
        length,
    )


def _expects_continue(headers: dict[str, str]) -> bool:
    return headers.get("expect", "").lower() == "100-continue"


class NativeRequest:
    """One request on a ``_Connection``: the ``CallRequest`` the routes get. Its body
    arrives through ``_feed`` / ``_complete`` as the parser sees it; ``read`` waits for
    the rest."""

    __slots__ = (
        "path_params", "headers", "started", "method", "path", "keep_alive", "answered", "loop",
        "_conn", "_query_string", "_query", "_chunks", "_size", "_done", "_limit",
        "_over", "_waiter", "_chunked", "_http10",
    )  # fmt: skip

    def __init__(
        self, conn: _Connection, method: str, url: bytes, headers: dict[str, str], http10: bool
    ) -> None:
        self._conn = conn
        self.loop = conn.loop
        self.method = method
        path, _, qs = url.partition(b"?")
        self.path = path.decode("latin-1")
        self._query_string = qs.decode("latin-1")
        self._query: dict[str, str] | None = None
        self.headers = headers
        self.path_params: dict[str, str] = {}
        self.started = False
        self.answered = False
        self.keep_alive = True
        self._chunks: list[bytes] = []
        self._size = 0
        self._done = False  # the whole body is in
        self._limit: int | None = None  # set once the app reads the body
        self._over = False  # the body passed the limit: the rest is dropped
        self._waiter: asyncio.Future | None = None
        self._chunked = not http10  # a stream is sent chunked (HTTP/1.0: ended by close)
        self._http10 = http10

    @property
    def query_params(self) -> dict[str, str]:
        if self._query is None:
            self._query = parse_query(self._query_string)
        return self._query

    # -- what the parser hands over --------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self._over:
            return
        self._size += len(data)
        if self._limit is not None and self._size > self._limit:
            self._over = True
            self._chunks.clear()
            self._wake()
            return
        self._chunks.append(data)
        if self._limit is None and self._size > UNREAD_BUFFER_BYTES:
            self._conn.pause_reading()  # until the app asks for the body

    def _complete(self) -> None:
        self._done = True
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- CallRequest -----------------------------------------------------------------

    async def read(self, limit: int) -> bytes:
        declared = self.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge
        self._limit = limit
        if self._size > limit:
            self._over = True
            self._chunks.clear()
        if not self._done and not self._size and _expects_continue(self.headers):
            self._conn.write(_CONTINUE)  # the client waits for it before sending the body
        while not self._done and not self._over:
            if self._conn.gone:
                raise ClientGone
            self._waiter = self.loop.create_future()
            self._conn.resume_reading()
            await self._waiter
        if self._over:
            raise BodyTooLarge
        return self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)

    async def disconnected(self) -> None:
        await self._conn.lost()

    def watch_gone(self, callback: Callable[[], None] | None) -> bool:
        self._conn.on_gone = callback  # one request is answered at a time
        if callback is not None and self._conn.gone:
            self.loop.call_soon(callback)
        return True

    async def start_stream(self) -> None:
        head = _STREAM_HEAD
        if self._chunked:
            head += b"transfer-encoding: chunked\r\n"
        if not self.keep_alive or self._http10:
            head += b"connection: close\r\n"
        self._conn.write(head + b"\r\n")
        self.started = True

    async def send_chunk(self, data: bytes) -> None:
        if self._conn.gone:
            raise ClientGone
        if data:
            self._conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        await self._conn.drained()
        if self._conn.gone:
            raise ClientGone

    async def finish(self, reply: Reply) -> None:
        self.answered = True
        conn = self._conn
        if conn.gone:
            return
        if self.started:
            body = reply.body if reply.media_type == SSE else b""  # a 499: the client is gone
            if self._chunked:
                framed = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
                conn.write(framed + b"0\r\n\r\n")
            elif body:
                conn.write(body)
            return
        if reply.close:
            self.keep_alive = False
        head = [_head(reply.status, reply.media_type, len(reply.body))]
        for name, value in reply.headers.items():
            if name != "connection":
                head.append(f"{name}: {value}\r\n".encode("latin-1"))
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        elif self._http10:
            head.append(b"connection: keep-alive\r\n")
        head.append(b"\r\n")
        if self.method != "HEAD":
            head.append(reply.body)
        conn.write(b"".join(head))


class _Connection(asyncio.Protocol):
    """One client connection: parses requests and runs each through the app, one at a
    time, in order (pipelined requests wait their turn with reading paused)."""

    def __init__(self, server: NativeServer) -> None:
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.gone = False
        self.on_gone: Callable[[], None] | None = None  # the request answered now wants to know
        self._lost: asyncio.Future | None = None
        self._drain: asyncio.Future | None = None
        self._paused_reading = False
        self._write_paused = False
        # the request being parsed, and its head so far
        self._url = b""
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        self._receiving: NativeRequest | None = None
        self._last: NativeRequest | None = None  # the newest whose head was parsed
        self._reframing: NativeRequest | None = None  # its body parsed under a made-up head
        self._current: NativeRequest | None = None  # the one being answered
        self._queue: deque[NativeRequest] = deque()  # pipelined, waiting
        # when the connection is closed unless a request comes (idle) or its head ends;
        # None while a request is answered. The server's sweep checks it once a second,
        # instead of a timer armed and cancelled for every request.
        self.deadline: float | None = None

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)
        self.deadline = self.loop.time() + IDLE_TIMEOUT_S

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._not_upgraded(data[exc.args[0] :])
        except httptools.HttpParserError as exc:  # a callback's raise comes wrapped in one
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"request head larger than {MAX_HEAD_BYTES} bytes")
            else:
                self._refuse(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self.server.connections.discard(self)
        for fut in (self._lost, self._drain):
            if fut is not None and not fut.done():
                fut.set_result(None)
        for request in (self._receiving, self._current):
            if request is not None:
                request._wake()
        on_gone, self.on_gone = self.on_gone, None
        if on_gone is not None:
            on_gone()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- httptools callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._head_bytes = 0
        if self._current is None:
            self.deadline = self.loop.time() + HEAD_TIMEOUT_S

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        old = self._headers.get(key)
        self._headers[key] = text if old is None else f"{old}, {text}"

    def on_headers_complete(self) -> None:
        if self._reframing is not None:  # the made-up head of an upgrade request's body
            self._receiving, self._reframing = self._reframing, None
            return
        parser = self.parser
        http10 = parser.get_http_version() == "1.0"
        request = NativeRequest(
            self, parser.get_method().decode("ascii"), self._url, self._headers, http10
        )
        request.keep_alive = parser.should_keep_alive()
        self._receiving = self._last = request
        if self._current is None:
            self._start(request)
        else:
            self._queue.append(request)
            self.pause_reading()  # one request ahead is enough

    def on_body(self, body: bytes) -> None:
        if self._receiving is not None:
            self._receiving._feed(body)

    def on_message_complete(self) -> None:
        if self._receiving is not None:
            self._receiving._complete()
            self._receiving = None

    def _not_upgraded(self, rest: bytes) -> None:
        """A request asked to switch protocols (``Upgrade: h2c``, a websocket): none is
        offered, so it is answered over HTTP/1.1, as RFC 9110 lets a server do. llhttp
        stops at such a request's head and ends the message there, leaving its body and
        whatever follows unparsed (``rest``): a fresh parser reads them, the body framed
        by a head made up from the request's own Content-Length or Transfer-Encoding."""
        self.parser = httptools.HttpRequestParser(self)
        request = self._last
        assert request is not None  # llhttp raises only once a head is parsed
        framing = [
            f"{name}: {request.headers[name]}\r\n"
            for name in ("content-length", "transfer-encoding")
            if name in request.headers
        ]
        if framing:
            request._done = False  # its body is still to come
            self._reframing = request
            rest = f"PUT / HTTP/1.1\r\n{''.join(framing)}\r\n".encode("latin-1") + rest
        if rest:
            self.data_received(rest)

    # -- the cycle ---------------------------------------------------------------------

    def _start(self, request: NativeRequest) -> None:
        self.deadline = None
        self._current = request
        self.server.busy += 1
        self.loop.create_task(self._answer(request))

    async def _answer(self, request: NativeRequest) -> None:
        try:
            await self.server.app.answer(request.method, request.path, request)
        except Exception:
            log.exception("unanswered request %s %s", request.method, request.path)
            if not request.answered and not request.started:
                request.keep_alive = False
                with contextlib.suppress(Exception):
                    await request.finish(Reply(500, b'{"error":{"message":"internal error"}}'))
        finally:
            self.server.busy -= 1
            self._done(request)

    def _done(self, request: NativeRequest) -> None:
        self._current = None
        self.on_gone = None
        if self.gone:
            return
        closing = (
            not request.keep_alive
            or (request.started and request._http10)
            or not request._done  # its body is not all read: the next request cannot be found
            or self.server.closing
        )
        if closing:
            self._close()
            return
        if self._queue:
            self._start(self._queue.popleft())
            self.resume_reading()
            return
        self.resume_reading()
        self.deadline = self.loop.time() + IDLE_TIMEOUT_S

    # -- helpers -----------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self.gone and self.transport is not None:
            self.transport.write(data)

    async def drained(self) -> None:
        if self._write_paused and not self.gone:
            if self._drain is None or self._drain.done():
                self._drain = self.loop.create_future()
            await self._drain

    async def lost(self) -> None:
        if self.gone:
            return
        if self._lost is None:
            self._lost = self.loop.create_future()
        await self._lost

    def pause_reading(self) -> None:
        if not self._paused_reading and self.transport is not None and not self.gone:
            self._paused_reading = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused_reading and not self.gone and self.transport is not None:
            self._paused_reading = False
            self.transport.resume_reading()

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            raise ValueError("request head too large")  # ends the parse: see data_received

    def _refuse(self, status: int, reason: str) -> None:
        """A request the parser could not take: an error in the generic body and the
        connection closed (what came after it on the connection cannot be framed). With
        an answer still under way, the connection just closes."""
        if self._current is None:
            reply = self.server.app.routes.served.refused(status, reason)
            head = _head(status, reply.media_type, len(reply.body))
            self.write(head + b"connection: close\r\n\r\n" + reply.body)
        self._close()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def close_if_idle(self) -> None:
        if self._current is None:
            self._close()

    def sweep(self, now: float) -> None:
        """Closed if idle, or in a head that never ended, past its deadline."""
        if self.deadline is not None and now > self.deadline and self._current is None:
            self._close()


class NativeServer:
    """The listening side: every connection, and how many requests are being answered."""

    def __init__(self, app: ProxyApp, loop: asyncio.AbstractEventLoop) -> None:
        self.app = app
        self.loop = loop
        self.connections: set[_Connection] = set()
        self.busy = 0
        self.closing = False
        self.server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; the port bound (``port`` 0: any free one)."""
        self.server = await self.loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True, backlog=2048
        )
        self._sweep()
        return self.server.sockets[0].getsockname()[1]

    def _sweep(self) -> None:
        now = self.loop.time()
        for conn in list(self.connections):
            conn.sweep(now)
        every = min(1.0, IDLE_TIMEOUT_S / 4, HEAD_TIMEOUT_S / 4)
        self._sweeper = self.loop.call_later(every, self._sweep)

    async def stop(self, drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Stop listening, let the calls under way finish, close every connection."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn.close_if_idle()
        deadline = self.loop.time() + drain_timeout
        while self.busy and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn._close()


async def run_native(app: ProxyApp, host: str, port: int, ready: Callable[[int], None]) -> None:
    """Serve ``app`` until SIGTERM or SIGINT, its lifespan around the serving. A start-up
    that fails ends the process (status 1) with its traceback on stderr, where
    ``infra.devstack.startup_error`` reads it."""
    loop = asyncio.get_running_loop()
    try:
        await app.startup()
    except Exception as exc:
        # Straight to stderr: the logging set-up goes through a queue whose thread dies
        # unflushed with the process, so a logged error would never be seen.
        sys.stderr.write(startup_failure(exc))
        sys.stderr.flush()
        raise SystemExit(1) from None
    server = NativeServer(app, loop)
    try:
        bound = await server.start(host, port)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        ready(bound)
        await stop.wait()
        await server.stop()
    finally:
        await app.shutdown()


def startup_failure(exc: BaseException) -> str:
    """The text a failed start-up leaves in the service's log: its own traceback."""
    text = "".join(traceback.format_exception(exc))
    return f"lifespan startup failed:\n{text.rstrip()}\n"


def serve_native(
    target: str, host: str, port: int, *, factory: bool = True, uvloop: bool = True
) -> None:
    """Run ``target`` (``module:callable``, a ``ProxyApp`` or its factory) on this
    process's event loop: uvloop where installed (and ``uvloop``), else asyncio's."""
    module, _, name = target.partition(":")
    app: Any = getattr(importlib.import_module(module), name)
    if factory:
        app = app()

    def ready(bound: int) -> None:
        log.info("proxy listening on http://%s:%d", host, bound)

    main = run_native(app, host, port, ready)
    try:
        import uvloop as fast
    except ImportError:
        fast = None
    if fast is not None and uvloop:
        fast.run(main)
    else:
        asyncio.run(main)
