"""The node side of the proxy bridge: a Unix socket that forwards to the proxy's TCP port.

A sandbox without network has only its own loopback. `bridge_inner.py` listens on
127.0.0.1:<proxy port> inside it and connects to this socket, which is bind-mounted in;
this forwarder carries the bytes on to the real proxy. Nothing else is reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    def __init__(self, socket_path: Path, target: tuple[str, int]) -> None:
        self.socket_path = socket_path
        self.target = target
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._on_client, path=str(self.socket_path))

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
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
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
