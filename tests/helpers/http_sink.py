"""A tiny real HTTP server that records POST bodies (callback receiver for tests)."""

from __future__ import annotations

import asyncio


class _LocalServer:
    """Listens on a free loopback port for the ``async with`` block; subclasses answer in
    ``_handle`` and say which ``path`` their ``url`` ends with."""

    path = ""
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}{self.path}"

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()


class HttpSink(_LocalServer):
    path = "/callback"

    def __init__(self, fail_first: int = 0, status: int = 200) -> None:
        self.bodies: list[bytes] = []
        self.requests = 0
        self.fail_first = fail_first
        self.status = status
        self.received = asyncio.Event()

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


class JsonServer(_LocalServer):
    """A tiny real HTTP/1.1 server (keep-alive) answering JSON by route: ``routes[(method,
    path)](request_json) -> (status, answer_json)``; unknown routes answer 404. Each
    request is kept in ``requests`` as (method, path, json)."""

    def __init__(self, routes: dict) -> None:
        self.routes = routes
        self.requests: list[tuple[str, str, object]] = []

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import orjson

        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target = lines[0].split(" ")[:2]
                length = 0
                for line in lines[1:]:
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                raw = await reader.readexactly(length) if length else b""
                doc = orjson.loads(raw) if raw else None
                path = target.split("?", 1)[0]
                self.requests.append((method, path, doc))
                route = self.routes.get((method, path))
                status, answer = route(doc) if route else (404, {"detail": "Not Found"})
                body = orjson.dumps(answer)
                writer.write(
                    f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
