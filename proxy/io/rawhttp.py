"""A minimal HTTP/1.1 keep-alive client on asyncio protocols, for engine calls.

Why not aiohttp: on the proxy's engine-call path aiohttp was ~23% of the proxy's CPU
(py-spy, docs/benchmarks/history.md); a bare protocol does the same call for a third of the CPU.
The engines speak plain HTTP/1.1 JSON with Content-Length or chunked bodies, so the client
needs little: one request per connection at a time, a bounded pool of idle connections,
a response parser (``ResponseParser``, pure), and a deadline per request.

Errors stay transport-level here (``ConnectFailed``, ``ConnectTimeout``,
``RequestTimeout``, ``Disconnected``, ``ProtocolError``); ``proxy.backends.http`` maps
them to ``BackendError``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from urllib.parse import urlsplit

from services.common.deadlines import Deadlines

_MAX_HEAD = 64 * 1024


class ConnectFailed(Exception):
    """The TCP (or TLS) connection could not be opened."""


class ConnectTimeout(Exception):
    pass


class RequestTimeout(Exception):
    pass


class Disconnected(Exception):
    """The server closed the connection before the response was complete."""

    def __init__(self, message: str, *, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response


class ProtocolError(Exception):
    """The server's bytes are not an HTTP/1.1 response this client understands."""


class ResponseParser:
    """Incremental HTTP/1.1 response parser: ``feed`` bytes until ``done``."""

    def __init__(self, *, head_request: bool = False) -> None:
        self._buf = bytearray()
        self._head_request = head_request
        self._state = "head"
        self._need = 0  # body bytes left (content-length) or in the current chunk
        self._chunks: list[bytes] = []
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        self.done = False

    @property
    def body(self) -> bytes:
        return b"".join(self._chunks)

    @property
    def started(self) -> bool:
        return self.status != 0 or bool(self._buf)

    def feed(self, data: bytes) -> None:
        self._buf += data
        while not self.done and self._step():
            pass

    def feed_eof(self) -> None:
        """The connection closed: a body delimited by the close ends here."""
        if self._state == "until_close":
            self._chunks.append(bytes(self._buf))
            self._buf.clear()
            self._finish()

    def _step(self) -> bool:
        """Advance one state; False when more bytes are needed."""
        return getattr(self, "_step_" + self._state)()

    def _step_head(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > _MAX_HEAD:
                raise ProtocolError("response head too large")
            return False
        head = bytes(self._buf[:end]).decode("latin-1")
        del self._buf[: end + 4]
        self._read_head(head)
        return True

    def _read_head(self, head: str) -> None:
        lines = head.split("\r\n")
        version, _, rest = lines[0].partition(" ")
        try:
            status = int(rest[:3])
        except ValueError:
            raise ProtocolError(f"bad status line {lines[0][:80]!r}") from None
        if not version.startswith("HTTP/1."):
            raise ProtocolError(f"bad status line {lines[0][:80]!r}")
        if 100 <= status < 200:
            return  # an interim answer (100 Continue): the real one follows
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.status, self.headers = status, headers
        conn = headers.get("connection", "").lower()
        self.keep_alive = "close" not in conn and (version == "HTTP/1.1" or "keep-alive" in conn)
        self._choose_body(status, headers)

    def _choose_body(self, status: int, headers: dict[str, str]) -> None:
        if self._head_request or status in (204, 304):
            self._finish()
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = "chunk_size"
        elif "content-length" in headers:
            try:
                self._need = int(headers["content-length"])
            except ValueError:
                raise ProtocolError("bad content-length") from None
            self._state = "length"
            if self._need == 0:
                self._finish()
        else:
            self._state = "until_close"
            self.keep_alive = False

    def _step_length(self) -> bool:
        if len(self._buf) < self._need:
            return False
        self._chunks.append(bytes(self._buf[: self._need]))
        del self._buf[: self._need]
        self._finish()
        return True

    def _step_chunk_size(self) -> bool:
        end = self._buf.find(b"\r\n")
        if end < 0:
            return False
        line = bytes(self._buf[:end]).split(b";", 1)[0].strip()
        del self._buf[: end + 2]
        try:
            self._need = int(line, 16)
        except ValueError:
            raise ProtocolError(f"bad chunk size {line[:20]!r}") from None
        self._state = "chunk_data" if self._need else "trailer"
        return True

    def _step_chunk_data(self) -> bool:
        if len(self._buf) < self._need + 2:
            return False
        self._chunks.append(bytes(self._buf[: self._need]))
        del self._buf[: self._need + 2]
        self._state = "chunk_size"
        return True

    def _step_trailer(self) -> bool:
        end = self._buf.find(b"\r\n")
        if end < 0:
            return False
        del self._buf[: end + 2]
        if end == 0:  # the empty line that ends the trailers
            self._finish()
        return True

    def _step_until_close(self) -> bool:
        return False

    def _finish(self) -> None:
        self.done = True
        self._state = "done"

    @property
    def leftover(self) -> bool:
        """Bytes past the end of the response: the connection cannot be trusted."""
        return bool(self._buf)


class Connection(asyncio.Protocol):
    """One kept-alive connection; carries one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser: ResponseParser | None = None
        self._waiter: asyncio.Future[ResponseParser] | None = None
        # made in the loop that uses it: asking the loop per call costs a getpid() syscall
        # on Python 3.11 (the running loop's fork check)
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:  # bytes nobody asked for: never reuse this connection
            self.close()
            return
        try:
            parser.feed(data)
        except ProtocolError as exc:
            self._fail(exc)
            self.close()
            return
        if parser.done:
            self._complete(parser)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        parser = self._parser
        if parser is None:
            return
        parser.feed_eof()
        if parser.done:
            self._complete(parser)
            return
        reason = f"{type(exc).__name__}: {exc}" if exc else "server closed the connection"
        self._fail(Disconnected(reason, before_response=not parser.started))

    async def roundtrip(
        self, request: bytes, parser: ResponseParser, timeout_s: float, deadlines: Deadlines
    ):
        self._parser = parser
        # No busy-poll here (``proxy.io.spin``): an engine takes milliseconds at least to
        # generate, so polling for its reply would only burn the budget on every call
        self._waiter = waiter = self.loop.create_future()
        deadlines.add(waiter, timeout_s, self._on_timeout)
        try:
            self.transport.write(request)
            return await waiter
        finally:
            self._parser = self._waiter = None

    def reusable(self, parser: ResponseParser) -> bool:
        return not self.closed and parser.keep_alive and not parser.leftover

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _on_timeout(self) -> None:
        self._fail(RequestTimeout("timed out"))
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _complete(self, parser: ResponseParser) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(parser)

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)


class ConnectionPool:
    """Up to ``limit`` connections to one origin; idle ones are reused newest first."""

    def __init__(
        self,
        base_url: str,
        *,
        limit: int,
        keepalive_s: float,
        connect_timeout_s: float,
        headers: dict[str, str] | None = None,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https"):
            raise ValueError(f"{base_url}: only http:// and https:// are supported")
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        self._prefix = url.path.rstrip("/")
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: deque[Connection] = deque()
        self._deadlines: Deadlines | None = None  # the requests', on one timer
        self._closed = False
        self._slots = asyncio.Semaphore(limit)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._fixed = f"Host: {url.netloc}\r\n{extra}".encode("latin-1")

    def encode(self, method: str, target: str, body: bytes | None) -> bytes:
        """The request's bytes: request line, fixed headers, length, body."""
        line = f"{method} {self._prefix}{target} HTTP/1.1\r\n".encode("latin-1")
        if body is None:
            return line + self._fixed + b"\r\n"
        length = b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        return line + self._fixed + length + body

    async def send(self, request: bytes, timeout_s: float, *, head: bool = False):
        """One request -> the finished ``ResponseParser``; retries once a stale reuse."""
        async with self._slots:
            conn, reused = self._take_idle(), True
            if conn is None:
                conn, reused = await self._open(), False
            try:
                parser = await conn.roundtrip(
                    request, ResponseParser(head_request=head), timeout_s, self._due(conn)
                )
            except Disconnected as exc:
                conn.close()
                if not (reused and exc.before_response):
                    raise
                # The server closed this idle connection as we sent: one fresh try.
                conn = await self._open()
                parser = await self._roundtrip_fresh(conn, request, head, timeout_s)
            except BaseException:
                conn.close()
                raise
            self._give_back(conn, parser)
            return parser

    def _due(self, conn: Connection) -> Deadlines:
        deadlines = self._deadlines
        if deadlines is None or deadlines.loop is not conn.loop:
            deadlines = self._deadlines = Deadlines(conn.loop)
        return deadlines

    async def _roundtrip_fresh(self, conn, request, head, timeout_s):
        try:
            return await conn.roundtrip(
                request, ResponseParser(head_request=head), timeout_s, self._due(conn)
            )
        except BaseException:
            conn.close()
            raise

    def _take_idle(self) -> Connection | None:
        oldest_ok = time.monotonic() - self.keepalive_s
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.idle_since >= oldest_ok:
                return conn
            conn.close()
        return None

    def _give_back(self, conn: Connection, parser: ResponseParser) -> None:
        if self._closed or not conn.reusable(parser):
            conn.close()
            return
        conn.idle_since = now = time.monotonic()
        self._idle.append(conn)
        idle = self._idle
        while idle[0].closed or idle[0].idle_since < now - self.keepalive_s:
            idle.popleft().close()  # never empties it: the one just added is fresh

    async def _open(self) -> Connection:
        loop = asyncio.get_running_loop()
        connect = loop.create_connection(Connection, self.host, self.port, ssl=self._ssl)
        try:
            _, conn = await asyncio.wait_for(connect, self.connect_timeout_s)
        except TimeoutError:
            raise ConnectTimeout("connect timed out") from None
        except OSError as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from None
        return conn

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()
