"""A tiny real HTTP server that records POST bodies (callback receiver for tests)."""

from __future__ import annotations

import asyncio


class HttpSink:
    def __init__(self, fail_first: int = 0, status: int = 200) -> None:
        self.bodies: list[bytes] = []
        self.requests = 0
        self.fail_first = fail_first
        self.status = status
        self.server: asyncio.Server | None = None
        self.received = asyncio.Event()

    @property
    def url(self) -> str:
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}/callback"

    async def __aenter__(self) -> HttpSink:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length)
        self.requests += 1
        status = 500 if self.requests <= self.fail_first else self.status
        if status < 300:
            self.bodies.append(body)
            self.received.set()
        writer.write(
            f"HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".encode()
        )
        await writer.drain()
        writer.close()
