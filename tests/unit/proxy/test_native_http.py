"""``proxy.io.native``, the proxy's HTTP/1.1 server, at the socket: what the SDK tests
(tests/integration/test_proxy_sdks.py, real clients) do not reach. Pipelined requests,
``Expect: 100-continue``, bytes arriving one at a time, HTTP/1.0, HEAD, malformed and
oversized heads, the idle timeout, and a shutdown that lets a call under way finish.
Each test serves the real proxy app (a scripted model) on a free port in its own loop
and talks raw HTTP to it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from proxy.app import create_app
from proxy.io import native
from proxy.io.limits import HttpLimits
from proxy.io.native import NativeServer
from tests.unit.protocols.app_support import CHAT, TOKEN, Scripted, resolve

PATH = f"/s/{TOKEN}{CHAT[0]}"
BODY = json.dumps(CHAT[1]).encode()


def post(path: str = PATH, body: bytes = BODY, extra: str = "", version: str = "1.1") -> bytes:
    head = (
        f"POST {path} HTTP/{version}\r\nhost: t\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


@pytest.fixture
async def served() -> AsyncIterator[tuple[NativeServer, int, Scripted]]:
    model = Scripted()
    app = create_app(model.prepare, resolve, max_body_bytes=10_000, keepalive_seconds=0.1)
    await app.startup()
    server = NativeServer(app, asyncio.get_running_loop())
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port, model
    finally:
        await server.stop(drain_timeout=1.0)
        await app.shutdown()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers, body (sized or chunked)."""
    status_line = await reader.readline()
    assert status_line, "connection closed before a response"
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    if headers.get("transfer-encoding") == "chunked":
        while size := int((await reader.readline()).strip(), 16):
            body += await reader.readexactly(size)
            await reader.readline()
        await reader.readline()
    return status, headers, body


async def connect(port: int):
    return await asyncio.open_connection("127.0.0.1", port)


async def closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), 5) == b""


async def test_kept_alive_requests_and_pipelined_ones_are_answered_in_order(served) -> None:
    _, port, model = served
    reader, writer = await connect(port)
    writer.write(post())
    status, headers, body = await read_response(reader)
    assert status == 200 and "connection" not in headers
    assert json.loads(body)["choices"][0]["message"]["tool_calls"]
    # three at once: a 200, a 401 (unknown token) and a 200, in that order
    writer.write(post() + post(path=f"/s/nope{CHAT[0]}") + post())
    answers = [await read_response(reader) for _ in range(3)]
    assert [a[0] for a in answers] == [200, 401, 200]
    assert len(model.calls) == 3
    writer.close()


async def test_a_request_arriving_a_byte_at_a_time_is_answered(served) -> None:
    _, port, _ = served
    reader, writer = await connect(port)
    for i in range(len(request := post())):
        writer.write(request[i : i + 1])
        await writer.drain()
    assert (await read_response(reader))[0] == 200
    writer.close()


async def test_expect_100_continue_is_answered_when_the_body_is_read(served) -> None:
    _, port, _ = served
    reader, writer = await connect(port)
    head, _, body = post(extra="expect: 100-continue\r\n").partition(b"\r\n\r\n")
    writer.write(head + b"\r\n\r\n")
    assert await asyncio.wait_for(reader.readline(), 5) == b"HTTP/1.1 100 Continue\r\n"
    assert await reader.readline() == b"\r\n"
    writer.write(body)
    assert (await read_response(reader))[0] == 200
    writer.close()


async def test_a_chunked_body_is_read_and_a_slow_stream_sent_chunked(served) -> None:
    _, port, model = served
    model.delay = 0.35  # past the keep-alive interval: the stream starts before the answer
    body = json.dumps({**CHAT[1], "stream": True}).encode()
    chunked = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in (body[:10], body[10:])) + b"0\r\n\r\n"
    head = f"POST {PATH} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
    reader, writer = await connect(port)
    writer.write(head.encode() + chunked)
    status, headers, events = await read_response(reader)
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert headers["transfer-encoding"] == "chunked"
    assert events.startswith(b": keep-alive") or events.count(b"\n\n") > 3
    assert events.rstrip().endswith(b"data: [DONE]")
    model.delay = 0
    writer.write(post())  # the connection is still good
    assert (await read_response(reader))[0] == 200
    writer.close()


async def test_http_1_0_is_answered_and_closed(served) -> None:
    _, port, _ = served
    reader, writer = await connect(port)
    writer.write(post(version="1.0"))
    status, headers, _ = await read_response(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await closed(reader)


async def test_head_gets_the_headers_without_a_body(served) -> None:
    _, port, _ = served
    reader, writer = await connect(port)
    writer.write(b"HEAD / HTTP/1.1\r\nhost: t\r\n\r\nHEAD /api/hello HTTP/1.1\r\nhost: t\r\n\r\n")
    assert (await read_response(reader))[0] == 200
    assert (await read_response(reader))[0] == 200  # nothing left between them
    writer.close()


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: x\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nx-big: " + b"a" * (native.MAX_HEAD_BYTES + 1) + b"\r\n\r\n", 431),
    ],
    ids=["garbage", "bad-length", "head-too-large"],
)
async def test_a_request_that_cannot_be_parsed_is_refused_and_closed(
    served, request_bytes, status
) -> None:
    _, port, model = served
    reader, writer = await connect(port)
    writer.write(request_bytes)
    got, headers, body = await read_response(reader)
    assert got == status and headers["connection"] == "close"
    assert "message" in json.loads(body)["error"]  # the one error body every SDK reads
    assert await closed(reader)
    assert model.calls == []


async def test_a_body_over_the_limit_is_a_413_and_the_connection_closes(served) -> None:
    _, port, model = served
    reader, writer = await connect(port)
    big = json.dumps({**CHAT[1], "pad": "x" * 20_000}).encode()
    head = f"POST {PATH} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
    writer.write(head.encode() + b"%x\r\n%b\r\n" % (len(big), big))  # no end: more to come
    status, headers, _ = await read_response(reader)
    assert status == 413 and headers["connection"] == "close"
    assert await closed(reader)
    assert model.calls == []


async def test_an_idle_kept_alive_connection_is_closed(served) -> None:
    server, port, _ = served
    server.limits = HttpLimits(idle_timeout_seconds=0.2)
    reader, writer = await connect(port)
    writer.write(post())
    assert (await read_response(reader))[0] == 200
    assert await closed(reader)


async def test_a_head_that_never_ends_is_cut_off(served) -> None:
    server, port, _ = served
    server.limits = HttpLimits(head_timeout_seconds=0.2)
    reader, writer = await connect(port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n")  # and nothing more
    assert await closed(reader)


async def test_shutdown_lets_a_call_under_way_finish_then_closes(served) -> None:
    server, port, model = served
    model.delay = 0.3
    busy_reader, busy_writer = await connect(port)
    idle_reader, idle_writer = await connect(port)
    busy_writer.write(post())
    await asyncio.sleep(0.1)  # the call is under way
    stopping = asyncio.ensure_future(server.stop(drain_timeout=5))
    assert await closed(idle_reader)  # an idle connection goes at once
    status, headers, _ = await read_response(busy_reader)
    assert status == 200
    await stopping
    assert await closed(busy_reader)
    with pytest.raises(OSError):
        await connect(port)  # no longer listening


async def test_an_upgrade_it_does_not_offer_is_answered_over_http_1_1(served) -> None:
    """``Upgrade: h2c`` (curl --http2 on http://) and the like: the request is answered as
    HTTP/1.1 with its whole body, sized or chunked, and the next request on the
    connection after it too (llhttp alone would stop at the head and drop the rest)."""
    _, port, model = served
    upgrade = "connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAA\r\n"
    reader, writer = await connect(port)
    sized = post(extra=upgrade)
    writer.write(sized[:-5])  # the body's end comes in a later read
    await asyncio.sleep(0.05)
    writer.write(sized[-5:] + post())
    assert [(await read_response(reader))[0] for _ in range(2)] == [200, 200]
    head = f"POST {PATH} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n{upgrade}\r\n"
    chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(BODY), BODY)
    writer.write(head.encode() + chunked)
    assert (await read_response(reader))[0] == 200
    writer.write(b"GET /v1/models HTTP/1.1\r\nhost: t\r\n" + upgrade.encode() + b"\r\n")
    writer.write(b"HEAD / HTTP/1.1\r\nhost: t\r\n\r\n")  # no body: parsed straight after
    assert (await read_response(reader))[0] == 401  # no token: answered, not upgraded
    assert (await read_response(reader))[0] == 200
    assert [call[3] for call in model.calls] == [BODY, BODY, BODY]  # every body whole
    writer.close()


def test_an_anthropic_overload_goes_out_as_529_overloaded():
    """It went out as `HTTP/1.1 529 Unknown` (issue 38.16): Anthropic says Overloaded."""
    from proxy.io.native import _STATUS_LINES, _status_line

    assert _status_line(529) == b"HTTP/1.1 529 Overloaded\r\n" == _STATUS_LINES[529]
    assert _status_line(599) == b"HTTP/1.1 599 Unknown\r\n"
