"""Load generator: ``concurrency`` keep-alive connections, a fixed number of requests.

    python -m tests.bench.proxy_bench.client '<json spec>'   -> one JSON line on stdout
    python -m tests.bench.proxy_bench.client < spec.json      (a spec too long for argv)

Spec: ``port``, ``paths`` (one per session; each gets its own connection and
``per_path`` requests), ``concurrency`` (sessions at once; default all), ``body`` (the
JSON request), ``headers`` (extra), ``stream`` (expect SSE ending in ``[DONE]``),
``one_connection`` (all sessions in turn over one connection), ``unique`` (the last user
message gets `` (request <tag>-<n>)`` appended, ``tag`` random per process and ``n`` a
counter over every request of the run, so no two requests carry the same prompt). A raw
asyncio protocol, so the client costs a few µs a call and never limits what is measured:
the request bytes are built once per path, or with ``unique`` spliced per call from a
body split once around the number. Latency is send -> last byte of the response (the
bytes are built before the clock starts).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator

MARK = "{{request-number}}"  # where ``unique`` splices its number (plain ASCII: no JSON escape)


class Response:
    __slots__ = ("status", "body")

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body


def parse_response(buf: bytes) -> tuple[Response | None, int]:
    """(a complete response, bytes it used) or (None, 0): Content-Length or chunked."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None, 0
    head = buf[:end].lower()
    status = int(head[9:12])
    start = end + 4
    at = head.find(b"\r\ncontent-length:")
    if at >= 0:
        stop = head.find(b"\r\n", at + 2)
        length = int(head[at + 17 : stop if stop > 0 else None].strip())
        if len(buf) < start + length:
            return None, 0
        return Response(status, buf[start : start + length]), start + length
    if b"transfer-encoding: chunked" not in head:
        return Response(status, b""), start
    return _chunked(buf, start, status)


def _chunked(buf: bytes, pos: int, status: int) -> tuple[Response | None, int]:
    parts = []
    while True:
        line_end = buf.find(b"\r\n", pos)
        if line_end < 0:
            return None, 0
        size = int(buf[pos:line_end].split(b";", 1)[0], 16)
        if size == 0:
            if len(buf) < line_end + 4:
                return None, 0
            return Response(status, b"".join(parts)), line_end + 4
        data_end = line_end + 2 + size
        if len(buf) < data_end + 2:
            return None, 0
        parts.append(buf[line_end + 2 : data_end])
        pos = data_end + 2


class Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.waiter: asyncio.Future | None = None
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is None or self.waiter.done():
            return
        resp, used = parse_response(self.buf)
        if resp is not None:
            self.buf = self.buf[used:]
            self.waiter.set_result(resp)

    def connection_lost(self, exc) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("server closed the connection"))

    async def call(self, request: bytes) -> Response:
        if self.transport.is_closing():  # closed by the server since the last answer
            raise ConnectionError("server closed the connection")
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.waiter


def _head(path: str, headers: dict[str, str]) -> bytes:
    """The request's head up to the content-length's value (the last header)."""
    lines = [f"POST {path} HTTP/1.1", "host: 127.0.0.1", "content-type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\ncontent-length: ").encode()


def build_request(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    return _head(path, headers) + str(len(body)).encode() + b"\r\n\r\n" + body


def split_body(body: dict) -> tuple[bytes, bytes]:
    """``body`` as JSON bytes, cut where the number goes: the last user message (a
    string) ends in `` (request <number>)``."""
    user = [m for m in body["messages"] if m.get("role") == "user"]
    if not user or not isinstance(user[-1].get("content"), str):
        raise ValueError("unique needs a user message with string content")
    marked = {**user[-1], "content": f"{user[-1]['content']} (request {MARK})"}
    messages = [marked if m is user[-1] else m for m in body["messages"]]
    raw = json.dumps({**body, "messages": messages}).encode()
    if raw.count(MARK.encode()) != 1:
        raise ValueError(f"the body must not contain {MARK!r} already")
    pre, post = raw.split(MARK.encode())
    return pre, post


def unique_request(
    path: str, body: dict, headers: dict[str, str], numbers: Iterator[str]
) -> Callable[[], bytes]:
    """A maker of ``path``'s request bytes, each call with the next of ``numbers``."""
    head, (pre, post) = _head(path, headers), split_body(body)
    end = b"\r\n\r\n"

    def make() -> bytes:
        data = pre + next(numbers).encode() + post
        return head + str(len(data)).encode() + end + data

    return make


def numbers(tag: str | None = None) -> Iterator[str]:
    """``<tag>-0``, ``<tag>-1``, ...: ``tag`` random unless given (no two runs repeat)."""
    tag = tag or os.urandom(6).hex()
    return (f"{tag}-{n}" for n in itertools.count())


def ok(resp: Response, stream: bool) -> bool:
    if resp.status != 200:
        return False
    return b"[DONE]" in resp.body if stream else b'"choices"' in resp.body


async def session(port: int, requests, n: int, stream: bool, out: list, bad: list) -> None:
    """One connection: each of ``requests`` (bytes, or a maker of them per call) sent
    ``n`` times, one after another."""
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(Connection, "127.0.0.1", port)
    try:
        for request in requests:
            make = None if isinstance(request, bytes) else request
            for _ in range(n):
                if make is not None:
                    request = make()
                t0 = time.perf_counter()
                try:
                    resp = await conn.call(request)
                except ConnectionError as exc:  # the server hung up: a bad answer, reconnect
                    resp = Response(0, str(exc).encode())
                    conn.transport.close()
                    _, conn = await loop.create_connection(Connection, "127.0.0.1", port)
                out.append(time.perf_counter() - t0)
                if not ok(resp, stream):
                    bad.append(resp.status)
                    if len(bad) == 1:
                        sys.stderr.write(f"bad answer {resp.status}: {resp.body[:300]!r}\n")
    finally:
        conn.transport.close()


async def run(spec: dict) -> dict:
    headers = spec.get("headers", {})
    if spec.get("unique"):  # one counter over every path and session of the run
        count = numbers()
        requests = [unique_request(p, spec["body"], headers, count) for p in spec["paths"]]
    else:
        body = json.dumps(spec["body"]).encode()
        requests = [build_request(p, body, headers) for p in spec["paths"]]
    latencies: list[float] = []
    bad: list[int] = []
    port, n, stream = spec["port"], spec["per_path"], spec["stream"]
    pending = iter(requests)

    async def lane() -> None:  # one session after another, each on its own connection
        for request in pending:
            await session(port, [request], n, stream, latencies, bad)

    t0 = time.perf_counter()
    if spec.get("one_connection"):  # sessions in turn over one kept-alive connection
        await session(port, requests, n, stream, latencies, bad)
    else:
        await asyncio.gather(*(lane() for _ in range(spec.get("concurrency", len(requests)))))
    wall = time.perf_counter() - t0
    return {"latencies": latencies, "wall": wall, "bad": len(bad), "statuses": sorted(set(bad))}


def main() -> None:
    spec = json.loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read())
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    print(json.dumps(runner(run(spec))))


if __name__ == "__main__":
    main()
