"""The node side of the proxy bridge: a Unix socket that forwards to the proxy's TCP port.

A sandbox without network has only its own loopback. `bridge_inner.py` listens on
127.0.0.1:<proxy port> inside it and connects to this socket, which is bind-mounted in;
this forwarder carries the requests on to the real proxy. Nothing else is reachable.

The forwarder reads the sandbox's side as HTTP/1.x, request by request, and passes on
only requests for its own session's routes (``/s/<its token>/…``, where the harness's
base URL points): another session's token (leaked, guessed), the proxy's ``/admin/*``,
``/metrics`` and anything else at its root answer 403 here, and so do requests it cannot
frame safely (both Content-Length and chunked, two Content-Lengths, an Upgrade, dot
segments or encoded slashes in the path). A bridge given no token passes nothing.
Replies go back as they come.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
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
_ENCODED_TRICKS = (b"%2e", b"%2f", b"%5c", b"\\")


class Refused(Exception):
    """A request the sandbox may not send to the proxy (the reason, for its 403)."""


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
    method, target = parts[0], parts[1]
    if method == b"CONNECT" or not path_allowed(target, token):
        # the target is not echoed: it may carry another session's token
        raise Refused("a sandbox reaches only its own session's proxy routes (/s/<token>/...)")
    lengths, chunked = [], False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            lengths.append(value)
        elif name == b"transfer-encoding":
            if value != b"chunked":
                raise Refused(f"transfer-encoding {value.decode('latin-1')!r}")
            chunked = True
        elif name == b"upgrade":
            raise Refused("no protocol upgrades through the proxy bridge")
    if chunked and lengths or len(set(lengths)) > 1:
        raise Refused("ambiguous request framing (Content-Length with chunked, or two lengths)")
    if chunked:
        return "chunked", 0
    if lengths and not lengths[0].isdigit():
        raise Refused(f"bad Content-Length {lengths[0]!r}")
    return "length", int(lengths[0]) if lengths else 0


def forbidden(why: str) -> bytes:
    body = json.dumps({"error": {"type": "forbidden", "message": why}}).encode()
    head = (
        "HTTP/1.1 403 Forbidden\r\ncontent-type: application/json\r\n"
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
        writer.write(line)
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise Refused("bad chunk size") from None
        if size == 0:  # trailers, up to the blank line
            while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                writer.write(trailer)
            writer.write(b"\r\n")
            await writer.drain()
            return
        await _copy(reader, writer, size + 2)


async def _requests(
    reader: asyncio.StreamReader,
    upstream: asyncio.StreamWriter,
    client: asyncio.StreamWriter,
    token: str | None,
) -> None:
    """The sandbox's requests, one by one, to the proxy; the first refused one is
    answered 403 and ends the connection."""
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError:
                raise Refused("request head over 64 KiB") from None
            except asyncio.IncompleteReadError:
                break  # the sandbox closed its side
            kind, length = request_framing(head[:-4], token)
            upstream.write(head)
            if kind == "chunked":
                await _copy_chunked(reader, upstream)
            else:
                await _copy(reader, upstream, length)
            await upstream.drain()
        if upstream.can_write_eof():
            upstream.write_eof()
    except Refused as exc:
        client.write(forbidden(str(exc)))
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
        self._conns.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            self._conns.discard(task)
            return
        try:
            await asyncio.gather(
                _requests(reader, up_writer, writer, self.token), _pipe(up_reader, writer)
            )
        finally:
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
