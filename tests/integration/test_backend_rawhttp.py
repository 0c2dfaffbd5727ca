"""The raw engine HTTP client over real sockets: keep-alive, chunking, closes, timeouts.

Each test runs a scripted asyncio server on 127.0.0.1 whose ``answer`` decides, per
request, what bytes go back (or whether the connection is closed or left hanging), and
which counts the connections it accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest

from proxy.backends.base import BackendError, ErrorKind
from proxy.backends.http import HttpSettings, HttpWorker
from proxy.io import rawhttp
from tests.helpers.node import wait_until

pytestmark = pytest.mark.timeout(20)


def ok(body: bytes, *extra: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in extra)
    return b"HTTP/1.1 200 OK\r\n%scontent-length: %d\r\n\r\n%s" % (head.encode(), len(body), body)


class Scripted:
    """Answers each request with ``answer(n, head, body)``: bytes, (delay, bytes),
    "close" or "hang"."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self._server.close()
        for w in list(self._writers):
            w.close()
        await self._server.wait_closed()

    async def close_idle(self) -> None:
        for w in list(self._writers):
            w.close()

    async def _serve(self, reader, writer) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                reply = self.answer(len(self.requests), head, body)
                if reply == "close":
                    return
                if reply == "hang":
                    await asyncio.sleep(30)
                if isinstance(reply, tuple):  # (delay, bytes)
                    await asyncio.sleep(reply[0])
                    reply = reply[1]
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


@contextlib.asynccontextmanager
async def serving(answer, settings: HttpSettings | None = None):
    server = Scripted(answer)
    worker = HttpWorker(await server.start(), settings)
    try:
        yield server, worker
    finally:
        await worker.aclose()
        await server.stop()


async def test_sequential_calls_reuse_one_kept_alive_connection():
    async with serving(lambda n, h, b: ok(b'{"n": %d}' % n)) as (server, worker):
        answers = [await worker.post_json("/generate", {"i": i}) for i in range(5)]
    assert answers == [{"n": n} for n in range(1, 6)] and server.connections == 1


async def test_request_bytes_carry_path_query_json_body_and_auth():
    settings = HttpSettings(api_key="k1")
    async with serving(lambda n, h, b: ok(b"{}"), settings) as (server, worker):
        await worker.request("POST", "/update", {"a": 1}, params={"x": "1 2", "y": "z"})
    head, body = server.requests[0].split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /update?x=1+2&y=z HTTP/1.1" and body == b'{"a":1}'
    assert {"Authorization: Bearer k1", "Content-Type: application/json"} <= set(lines)


async def test_concurrent_calls_open_connections_up_to_the_limit():
    settings = HttpSettings(max_connections=3)
    async with serving(lambda n, h, b: (0.05, ok(b"1")), settings) as (server, worker):
        assert await asyncio.gather(*(worker.get_json("/x") for _ in range(12))) == [1] * 12
        assert server.connections == 3  # 12 calls at once, never more than 3 sockets
        await worker.get_json("/x")
    assert server.connections == 3


async def test_chunked_response_is_reassembled_and_connection_reused():
    chunked = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b'4\r\n{"a"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n'
    )
    async with serving(lambda n, h, b: chunked) as (server, worker):
        assert await worker.get_json("/model_info") == {"a": 1}
        assert await worker.get_json("/model_info") == {"a": 1}
    assert server.connections == 1


async def test_connection_close_header_is_honoured():
    async with serving(lambda n, h, b: ok(b"1", "Connection: close")) as (server, worker):
        for _ in range(3):
            assert await worker.get_json("/x") == 1
    assert server.connections == 3


async def test_idle_connection_closed_by_server_is_retried_once_on_a_fresh_one():
    async with serving(lambda n, h, b: ok(b"%d" % n)) as (server, worker):
        assert await worker.get_json("/x") == 1
        await server.close_idle()
        await asyncio.sleep(0.05)  # the close has reached the client: it opens anew
        assert await worker.get_json("/x") == 2
        assert server.connections == 2


async def test_reused_connection_closed_as_the_request_is_sent_is_retried():
    # The server answers once, then closes the connection on the next request without
    # answering (the race of a keep-alive expiring): the client retries on a new one.
    answers = {1: ok(b"1"), 2: "close"}
    async with serving(lambda n, h, b: answers.get(n, ok(b"3"))) as (server, worker):
        assert await worker.get_json("/x") == 1
        assert await worker.get_json("/x") == 3
    assert server.connections == 2 and len(server.requests) == 3


async def test_fresh_connection_closed_without_answer_is_unavailable_and_not_retried():
    async with serving(lambda n, h, b: "close") as (server, worker):
        with pytest.raises(BackendError) as err:
            await worker.post_json("/generate", {"input_ids": [1]})
    assert err.value.kind is ErrorKind.UNAVAILABLE and err.value.worker == worker.base_url
    assert len(server.requests) == 1  # a POST /generate is never sent twice on a fresh try


async def test_close_mid_body_is_unavailable():
    cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial"

    def answer(n, h, b):
        return cut if n == 1 else ok(b"1")

    server = Scripted(answer)
    base = await server.start()
    pool = rawhttp.ConnectionPool(base, limit=2, keepalive_s=4, connect_timeout_s=1)
    task = asyncio.create_task(pool.send(pool.encode("GET", "/x", None), 5))
    # the partial answer is written in the step that records the request: closed before
    # it, the client would see no response at all
    await wait_until(lambda: server.requests, 10, "the request answered in part")
    await server.close_idle()
    with pytest.raises(rawhttp.Disconnected) as err:
        await task
    assert not err.value.before_response
    pool.close()
    await server.stop()


async def test_slow_answer_times_out_and_the_connection_is_not_reused():
    async with serving(lambda n, h, b: "hang" if n == 1 else ok(b"2")) as (server, worker):
        start = time.monotonic()
        with pytest.raises(BackendError) as err:
            await worker.get_json("/x", timeout_s=0.2)
        assert err.value.kind is ErrorKind.TIMEOUT and time.monotonic() - start < 5  # not 30
        assert await worker.get_json("/x") == 2
    assert server.connections == 2


async def test_refused_connection_is_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connects are refused
        worker = HttpWorker(f"http://127.0.0.1:{port}")
        with pytest.raises(BackendError) as err:
            await worker.get_json("/health")
    assert err.value.kind is ErrorKind.UNAVAILABLE and err.value.retryable
    assert "ConnectFailed" in err.value.message and f":{port}" in err.value.message


async def test_error_status_bodies_go_through_engine_error_parsing():
    body = b'{"object": "error", "message": "maximum context length is 8", "code": 400}'
    reply = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    async with serving(lambda n, h, b: reply) as (server, worker):
        with pytest.raises(BackendError) as err:
            await worker.post_json("/v1/completions", {})
        assert err.value.kind is ErrorKind.CONTEXT_LENGTH and err.value.status == 400
        with pytest.raises(BackendError):
            await worker.post_json("/v1/completions", {})
    assert server.connections == 1  # an error answer leaves the connection usable


async def test_idle_connections_past_keepalive_are_not_reused():
    settings = HttpSettings(keepalive_s=0.05)
    async with serving(lambda n, h, b: ok(b"1"), settings) as (server, worker):
        await worker.get_json("/x")
        await asyncio.sleep(0.1)
        await worker.get_json("/x")
    assert server.connections == 2


async def test_the_loop_sleeps_while_the_engine_generates(monkeypatch):
    """No busy-poll while an engine request is out (``proxy.io.spin``): a generation
    takes milliseconds at least, and polling through it would burn the budget every call."""
    from proxy.io.spin import POLL

    monkeypatch.setattr(POLL, "budget", 1.0)
    async with serving(lambda n, h, b: (0.05, ok(b"{}"))) as (_server, worker):
        ticks = POLL.ticks
        assert await worker.post_json("/generate", {}) == {}
    assert POLL.ticks == ticks and POLL.pending == 0
