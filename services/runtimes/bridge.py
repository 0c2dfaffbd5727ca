"""The node side of the proxy bridge: a Unix socket that forwards to the proxy's TCP port.

A sandbox without network has only its own loopback. `bridge_inner.py` listens on
127.0.0.1:<proxy port> inside it and connects to this socket, which is bind-mounted in;
this forwarder carries the requests on to the real proxy. Nothing else is reachable.

The forwarder reads the sandbox's side as HTTP/1.x, request by request, and passes on
only requests for its own session's routes (``/s/<its token>/…``, where the harness's
base URL points): another session's token (leaked, guessed), the proxy's ``/admin/*``,
``/metrics`` and anything else at its root answer 403 here, and so do an Upgrade, dot
segments or encoded slashes in the path. A bridge given no token passes nothing.

It frames requests as strictly as the proxy's own parser (llhttp, plus RFC 9112's rules in
``proxy.io.limits``), so the two never disagree on where a request ends: a request it
cannot frame that way is a 400 here, never forwarded (a folded or indented header line,
whitespace before a colon, a bare CR or LF, a Content-Length twice or with a chunked body,
a chunk size that is not 1 to 16 hex digits, a transfer coding other than chunked, an
HTTP version other than 1.0 and 1.1). Replies go back as they come; once the proxy closes
the connection, the sandbox's side is closed too. At most ``MAX_CONNECTIONS`` at once
per sandbox (a 503 past them): its share of what the proxy admits from this address.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from services.runtimes.errors import SandboxConfigError

INNER_SCRIPT = Path(__file__).with_name("bridge_inner.py")
_CHUNK = 65536


def proxy_address(proxy_url: str) -> tuple[str, int]:
    """Host and port of an http:// proxy URL (TLS cannot be bridged to 127.0.0.1)."""
    parts = urlsplit(proxy_url)
    if parts.scheme != "http" or not parts.hostname:
        raise SandboxConfigError(f"the proxy bridge needs an http:// URL, got {proxy_url!r}")
    return parts.hostname, parts.port or 80


def inside_proxy_url(proxy_url: str) -> str:
    """The same URL as seen through the bridge: 127.0.0.1, same port and path."""
    parts = urlsplit(proxy_url)
    _, port = proxy_address(proxy_url)
    return urlunsplit((parts.scheme, f"127.0.0.1:{port}", parts.path, parts.query, ""))


MAX_HEAD = 64 * 1024
MAX_CONNECTIONS = 64  # open at once, per sandbox
_ENCODED_TRICKS = (b"%2e", b"%2f", b"%5c", b"\\")
# RFC 9110's token (a method, a field name), a field value without control characters
# (HTAB aside), a chunk-size line as llhttp reads it (at most 64 bits)
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})(;[^\x00-\x08\x0a-\x1f\x7f]*)?\r\n")
_PHRASES = {
    400: "Bad Request",
    403: "Forbidden",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


class Refused(Exception):
    """A request the sandbox may not send to the proxy: the reason, and its status
    (403: not its session's; 400: not framed as the proxy would frame it)."""

    def __init__(self, reason: str, status: int = 403) -> None:
        super().__init__(reason)
        self.status = status


class Malformed(Refused):
    """Not framed as the proxy would frame it: a 400, said to be the bridge's."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"proxy bridge: {reason}", 400)


def path_allowed(target: bytes, token: str | None) -> bool:
    """``token``'s session route: ``/s/<token>/<something>``, with no way to climb out of
    it (tokens are case-sensitive: only the checks for tricks ignore case)."""
    path = target.split(b"?", 1)[0]
    lowered = path.lower()
    if not path.startswith(b"/s/") or any(t in lowered for t in _ENCODED_TRICKS):
        return False
    segments = path.split(b"/")
    dots = b"." in segments or b".." in segments
    if len(segments) < 4 or not segments[2] or dots or not token:
        return False
    return hmac.compare_digest(segments[2], token.encode())


def request_framing(head: bytes, token: str | None) -> tuple[str, int]:
    """Check a request head (request line and headers, up to the blank line) for
    ``token``'s session and say how its body is framed: ("length", n) or ("chunked", 0).
    Raises Refused."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise Refused("the proxy bridge carries HTTP/1.x requests only")
    method, target, version = parts
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or not _TOKEN.fullmatch(method):
        raise Malformed("a request line it cannot read")
    if _CONTROL.search(target) or not target:
        raise Malformed("a request line it cannot read")
    if method == b"CONNECT" or not path_allowed(target, token):
        # the target is not echoed: it may carry another session's token
        raise Refused("a sandbox reaches only its own session's proxy routes (/s/<token>/...)")
    lengths, codings = [], []
    for name, value in _fields(lines[1:]):
        if name == b"content-length":
            lengths.append(value)
        elif name == b"transfer-encoding":
            codings.append(value.lower())
        elif name == b"upgrade":
            raise Refused("no protocol upgrades through the proxy bridge")
    if codings:
        if codings != [b"chunked"] or lengths or version == b"HTTP/1.0":
            raise Malformed("request framing other than one chunked body (Transfer-Encoding)")
        return "chunked", 0
    if len(lengths) > 1:
        raise Malformed("ambiguous request framing (two Content-Lengths)")
    if lengths and not lengths[0].isdigit():
        raise Malformed(f"bad Content-Length {lengths[0][:40]!r}")
    return "length", int(lengths[0]) if lengths else 0


def _fields(lines: list[bytes]) -> list[tuple[bytes, bytes]]:
    """Header (or trailer) lines as (lowercase name, value), read as llhttp reads them:
    a line that begins with whitespace (obs-fold), has whitespace or anything but a
    token before its colon, or a control character in its value is refused, where a
    looser reading would take it as a header of its own."""
    fields = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            raise Malformed(
                "a header line the proxy bridge cannot read (folded, or not name: value)"
            )
        value = value.strip(b" \t")
        if _CONTROL.search(value):
            raise Malformed("a control character in a header value")
        fields.append((name.lower(), value))
    return fields


def forbidden(why: str, status: int = 403) -> bytes:
    kind = "forbidden" if status == 403 else "invalid_request_error"
    body = json.dumps({"error": {"type": kind, "message": why}}).encode()
    head = (
        f"HTTP/1.1 {status} {_PHRASES.get(status, 'Error')}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    while n > 0:
        chunk = await reader.readexactly(min(n, _CHUNK))
        writer.write(chunk)
        await writer.drain()
        n -= len(chunk)


async def _copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        line = await reader.readuntil(b"\r\n")
        size = _CHUNK_SIZE.fullmatch(line)
        if size is None:
            raise Malformed("bad chunk size")
        writer.write(line)
        n = int(size[1], 16)
        if n == 0:  # trailers, up to the blank line
            while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                _fields([trailer[:-2]])
                writer.write(trailer)
            writer.write(b"\r\n")
            await writer.drain()
            return
        await _copy(reader, writer, n)
        if await reader.readexactly(2) != b"\r\n":
            raise Malformed("a chunk longer than its size")
        writer.write(b"\r\n")


async def _requests(
    reader: asyncio.StreamReader,
    upstream: asyncio.StreamWriter,
    client: asyncio.StreamWriter,
    token: str | None,
) -> None:
    """The sandbox's requests, one by one, to the proxy; the first refused one is
    answered (403, 400) and ends the connection."""
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError:
                raise Refused("request head over 64 KiB", 431) from None
            except asyncio.IncompleteReadError:
                break  # the sandbox closed its side
            kind, length = request_framing(head[:-4], token)
            upstream.write(head)
            try:
                if kind == "chunked":
                    await _copy_chunked(reader, upstream)
                else:
                    await _copy(reader, upstream, length)
            except asyncio.LimitOverrunError:
                raise Malformed("a chunk-size or trailer line over 64 KiB") from None
            await upstream.drain()
        if upstream.can_write_eof():
            upstream.write_eof()
    except Refused as exc:
        client.write(forbidden(str(exc), exc.status))
        with contextlib.suppress(ConnectionError, OSError):
            await client.drain()
        client.close()
        upstream.close()
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        pass


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(_CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


class ProxyBridge:
    """``token``: the session whose routes pass (None: none do)."""

    def __init__(self, socket_path: Path, target: tuple[str, int], token: str | None) -> None:
        self.socket_path = socket_path
        self.target = target
        self.token = token
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(
            self._on_client, path=str(self.socket_path), limit=MAX_HEAD
        )

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._conns) >= MAX_CONNECTIONS:
            writer.write(forbidden(f"more than {MAX_CONNECTIONS} connections at once", 503))
            writer.close()
            return
        self._conns.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            self._conns.discard(task)
            return
        sending = asyncio.ensure_future(_requests(reader, up_writer, writer, self.token))
        replies = asyncio.ensure_future(_pipe(up_reader, writer))
        try:
            await asyncio.wait((sending, replies), return_when=asyncio.FIRST_COMPLETED)
            if not replies.done():  # the sandbox has sent all it will: its answers still come
                await replies
            # else the proxy closed the connection: nothing more can be forwarded
        finally:
            for t in (sending, replies):
                t.cancel()
            await asyncio.gather(sending, replies, return_exceptions=True)
            for w in (writer, up_writer):
                w.close()
            self._conns.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.wait(list(self._conns), timeout=1.0)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
