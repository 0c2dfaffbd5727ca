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
to switch protocols (h2c, websocket) answered over HTTP/1.1 all the same.

Held to RFC 9112 (``proxy.io.limits.head_refusal``): a version other than HTTP/1.0 and
1.1 is a 505; a malformed head or body framing (a bad chunk size, a Content-Length in the
trailers), an HTTP/1.1 request without one Host is a 400; a transfer coding other than
chunked a 501; trailer fields are dropped, never merged into the headers. Each such error
is answered in its turn, after the answers to the requests before it on the connection,
and the connection is then closed (what follows cannot be framed).

Bounds (``HttpLimits``): a request head over ``MAX_HEAD_BYTES`` is a 431; a head not
complete within ``head_timeout_seconds`` (of its first byte, or of the connection's
opening) closes the connection, a body not in within ``body_timeout_seconds`` (extended
at ``body_min_bytes_per_second``) is a 408, an idle keep-alive connection is closed after
``idle_timeout_seconds``; connections past a cap get a 503 (``proxy.io.limits``). SIGTERM
or SIGINT: stop listening, let the calls under way finish (up to ``DRAIN_TIMEOUT_S``),
close, run the app's shutdown.
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

from proxy import metrics
from proxy.io.limits import (
    Admission,
    HttpLimits,
    ThrottledLog,
    connection_caps,
    head_refusal,
    open_files_limit,
    raise_open_files_limit,
)
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

MAX_HEAD_BYTES = 64 * 1024  # request line and headers (and, apart, the trailers)
DRAIN_TIMEOUT_S = 30.0  # at shutdown, for the calls under way
UNREAD_BUFFER_BYTES = 256 * 1024  # body held before the app asks for it; then reading pauses

# 529 is Anthropic's "Overloaded" (what its SDKs and Claude Code read as overload, and
# what the proxy answers an Anthropic caller when no engine can take the call)
_PHRASES = {s.value: s.phrase for s in http.HTTPStatus} | {529: "Overloaded"}
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


class _Refusal(Exception):
    """Raised in a parser callback: the request is answered by the server itself."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(status, reason)
        self.status, self.reason = status, reason


_AT_CAP = "the proxy is at its connection limit: retry later"


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
            self._conn.start_body_clock()
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
        self.limits = server.limits
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.client = ""  # the peer's address: what the per-client cap counts
        self.over: str | None = None  # the connection cap it is past, if any
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
        self._hosts = 0
        self._in_head = False  # between a message's first byte and its head's end
        self._head_since = 0.0
        self._receiving: NativeRequest | None = None
        self._last: NativeRequest | None = None  # the newest whose head was parsed
        self._reframing: NativeRequest | None = None  # its body parsed under a made-up head
        self._current: NativeRequest | None = None  # the one being answered
        self._queue: deque[NativeRequest] = deque()  # pipelined, waiting
        # the body being received: since when (None: not yet asked for, a 100-continue
        # not yet sent) and how many of its bytes had come by then
        self._body_since: float | None = None
        self._body_base = 0
        self._broken = False  # the parser stopped: nothing more is read
        self._refusal: tuple[int, str] | None = None  # answered after the requests before it
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
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.server.connections.add(self)
        self.over = self.server.admit(self)
        self.deadline = self.loop.time() + self.limits.head_timeout_seconds

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._not_upgraded(data[exc.args[0] :])
        except httptools.HttpParserError as exc:  # a callback's raise comes wrapped in one
            cause = exc.__context__
            if isinstance(cause, _Refusal):
                self._fail(cause.status, cause.reason)
            else:
                self._fail(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self.server.connections.discard(self)
        self.server.release(self)
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
        self._hosts = 0
        self._in_head = True
        self._head_since = now = self.loop.time()
        if self._current is None:
            due = now + self.limits.head_timeout_seconds
            self.deadline = due if self.deadline is None else min(self.deadline, due)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        if not self._in_head:
            return  # a trailer field: never a header (RFC 9110 6.5), and none is used
        key = name.decode("latin-1").lower()
        if key == "host":
            self._hosts += 1
        text = value.decode("latin-1")
        old = self._headers.get(key)
        self._headers[key] = text if old is None else f"{old}, {text}"

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0  # the trailers have a budget of their own
        if self._reframing is not None:  # the made-up head of an upgrade request's body
            self._receiving, self._reframing = self._reframing, None
            return
        parser = self.parser
        version = parser.get_http_version()
        refusal = head_refusal(version, self._headers, self._hosts)
        if refusal is not None:
            raise _Refusal(*refusal)
        method = parser.get_method().decode("ascii")
        if self.over is not None:  # past a cap: an operator's probe only, then closed
            path = self._url.partition(b"?")[0].decode("latin-1")
            if not self.server.app.routes.is_probe(method, path):
                raise _Refusal(503, _AT_CAP)
        request = NativeRequest(self, method, self._url, self._headers, version == "1.0")
        request.keep_alive = parser.should_keep_alive() and self.over is None
        self._receiving = self._last = request
        self._body_since = None if _expects_continue(self._headers) else self.loop.time()
        self._body_base = 0
        if self._current is None:
            self._start(request)
        else:
            self._queue.append(request)
            self.pause_reading()  # one request ahead is enough

    def on_body(self, body: bytes) -> None:
        receiving = self._receiving
        if receiving is not None:
            if self._body_since is None:  # sent without waiting for the 100 Continue
                self.start_body_clock()
            receiving._feed(body)

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
        elif self._queue:
            self._start(self._queue.popleft())
            self.resume_reading()
        elif self._refusal is not None:  # what came after the requests answered
            self._send_refusal(*self._refusal)
            self._close()
        else:
            self.resume_reading()
            now = self.loop.time()
            if self._in_head:  # the next head has begun
                self.deadline = self._head_since + self.limits.head_timeout_seconds
            else:
                self.deadline = now + self.limits.idle_timeout_seconds

    def _fail(self, status: int, reason: str) -> None:
        """The parser cannot go on (``status``, ``reason``): nothing after this point can
        be framed, so nothing more is read. The requests before it are answered in order,
        then this error, and the connection is closed. A request whose own body broke
        while it was answered gets the error at once, unless its answer is out."""
        metrics.HTTP_REFUSED.labels(str(status)).inc()
        self.server.refusals.warn(str(status), "refused a request: %d %s", status, reason)
        self._broken = True
        self.pause_reading()
        receiving, self._receiving = self._receiving, None
        current = self._current
        if receiving is not None and receiving in self._queue:
            self._queue.remove(receiving)  # its body broke while it waited its turn
        if current is None:
            self._send_refusal(status, reason)
            self._close()
        elif receiving is current:
            if not current.answered and not current.started:
                self._send_refusal(status, reason)
            self._abandon()
        else:
            self._refusal = (status, reason)

    def _send_refusal(self, status: int, reason: str) -> None:
        reply = self.server.app.routes.served.refused(status, reason)
        head = _head(status, reply.media_type, len(reply.body))
        if status == 503:
            head += b"retry-after: 1\r\n"
        self.write(head + b"connection: close\r\n\r\n" + reply.body)

    def _abandon(self) -> None:
        """Closed with a request under way: its app task sees the client gone."""
        self._close()
        self.gone = True
        for request in (self._current, *self._queue):
            if request is not None:
                request._wake()

    def shed(self) -> None:
        """Past a cap, and the oldest such: a 503 and closed, unless it is answering a
        probe (then closed after it)."""
        if self._current is None and not self.gone:
            metrics.HTTP_REFUSED.labels("503").inc()
            self._send_refusal(503, _AT_CAP)
            self._close()

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

    def start_body_clock(self) -> None:
        if self._receiving is not None:
            self._body_since = self.loop.time()
            self._body_base = self._receiving._size

    def pause_reading(self) -> None:
        if not self._paused_reading and self.transport is not None and not self.gone:
            self._paused_reading = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused_reading and not self.gone and not self._broken and self.transport:
            self._paused_reading = False
            self.transport.resume_reading()
            if self._body_since is not None:  # the client was not slow meanwhile
                self.start_body_clock()

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            what = "head" if self._in_head else "trailer section"
            raise _Refusal(431, f"request {what} larger than {MAX_HEAD_BYTES} bytes")

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def close_if_idle(self) -> None:
        if self._current is None:
            self._close()

    def sweep(self, now: float) -> None:
        """Closed if idle, or in a head that never ended, past its deadline; a 408 for a
        body that has not come in time."""
        if self._current is None:
            if self.deadline is not None and now > self.deadline:
                if self.over is not None:
                    self.shed()  # past a cap: told so
                else:
                    self._close()
            return
        receiving, since = self._receiving, self._body_since
        if receiving is None or since is None or self._paused_reading:
            return
        limits = self.limits
        came = receiving._size - self._body_base
        if now - since > limits.body_timeout_seconds + came / limits.body_min_bytes_per_second:
            self._fail(408, "the request body did not arrive in time")


class NativeServer:
    """The listening side: every connection, and how many requests are being answered.
    ``limits``: its bounds (default: the app's ``http_limits``); ``open_files``: the
    open-files limit the connection caps are derived from (default: this process's)."""

    def __init__(
        self,
        app: ProxyApp,
        loop: asyncio.AbstractEventLoop,
        limits: HttpLimits | None = None,
        open_files: int | None = None,
    ) -> None:
        self.app = app
        self.loop = loop
        self.limits = limits or app.http_limits
        self.caps = connection_caps(self.limits, open_files or open_files_limit())
        self.admission = Admission(self.caps)
        self.overflow: dict[_Connection, None] = {}  # past a cap, oldest first
        self.refusals = ThrottledLog()
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
        metrics.OPEN_CONNECTIONS.set_function(lambda: len(self.connections))
        metrics.CONNECTION_CAP.set(self.caps.total)
        self._sweep()
        return self.server.sockets[0].getsockname()[1]

    def admit(self, conn: _Connection) -> str | None:
        """None: ``conn`` is admitted; else the cap it is past (it is then read only for
        a probe, and the oldest such connection is shed when there are too many)."""
        over = self.admission.admit(conn.client)
        if over is not None:
            self.overflow[conn] = None
            if len(self.overflow) > self.caps.overflow:
                oldest = next(iter(self.overflow))
                del self.overflow[oldest]
                oldest.shed()
        return over

    def release(self, conn: _Connection) -> None:
        if conn.over is None:
            self.admission.release(conn.client)
        else:
            self.overflow.pop(conn, None)

    def _sweep(self) -> None:
        now = self.loop.time()
        for conn in list(self.connections):
            conn.sweep(now)
        self._sweeper = self.loop.call_later(self.limits.sweep_every, self._sweep)

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
    open_files = raise_open_files_limit()

    def ready(bound: int) -> None:
        caps = connection_caps(app.http_limits, open_files)
        log.info(
            "proxy listening on http://%s:%d (open files %d: connections at most %d, %s)",
            host,
            bound,
            open_files,
            caps.total,
            f"{caps.per_client} per client" if caps.per_client else "no cap per client",
        )

    main = run_native(app, host, port, ready)
    try:
        import uvloop as fast
    except ImportError:
        fast = None
    if fast is not None and uvloop:
        fast.run(main)
    else:
        asyncio.run(main)
