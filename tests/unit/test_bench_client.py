"""The proxy bench's load generator builds its request bytes right (``--unique-prompts``)."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from tests.bench.proxy_bench.client import (
    build_request,
    numbers,
    session,
    split_body,
    unique_request,
)

BODY = {
    "model": "bench-model",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Say hello."},
    ],
    "max_tokens": 32,
    "stream": False,
}
HEADERS = {"authorization": "Bearer k"}


def _parse(request: bytes) -> tuple[list[bytes], dict]:
    head, body = request.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    length = next(int(ln.split(b":", 1)[1]) for ln in lines if ln.startswith(b"content-length:"))
    assert length == len(body)
    return lines, json.loads(body)


def test_build_request_as_before() -> None:
    body = json.dumps(BODY).encode()
    expected = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        b"content-type: application/json\r\nauthorization: Bearer k\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    assert build_request("/v1/chat/completions", body, HEADERS) == expected


def test_unique_requests_are_valid_distinct_and_differ_only_in_the_user_message() -> None:
    count = numbers("t")
    make_a = unique_request("/s/a/v1/chat/completions", BODY, HEADERS, count)
    make_b = unique_request("/s/b/v1/chat/completions", BODY, HEADERS, count)
    made = [make() for make in itertools.islice(itertools.cycle([make_a, make_b]), 12)]
    users = []
    for n, request in enumerate(made):
        lines, doc = _parse(request)  # content-length matches, body is JSON
        assert lines[0] == b"POST /s/" + b"ab"[n % 2 :][:1] + b"/v1/chat/completions HTTP/1.1"
        assert b"authorization: Bearer k" in lines
        users.append(doc["messages"][-1]["content"])
        assert doc["messages"][:-1] == BODY["messages"][:-1]
        assert {k: v for k, v in doc.items() if k != "messages"} == {
            k: v for k, v in BODY.items() if k != "messages"
        }
    # one counter across both paths: all distinct, in order
    assert users == [f"Say hello. (request t-{n})" for n in range(12)]
    assert BODY["messages"][-1]["content"] == "Say hello."  # the spec's body is untouched


def test_numbers_random_tag_differs_per_run() -> None:
    a, b = next(numbers()), next(numbers())
    assert a.endswith("-0") and b.endswith("-0") and a != b


def test_split_body_needs_a_string_user_message() -> None:
    with pytest.raises(ValueError):
        split_body({"messages": [{"role": "system", "content": "x"}]})
    with pytest.raises(ValueError):
        split_body({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})
    pre, post = split_body(BODY)
    assert json.loads(pre + b"7" + post)["messages"][-1]["content"] == "Say hello. (request 7)"


async def test_a_server_that_hangs_up_is_a_bad_answer_not_a_crash() -> None:
    """A proxy under test that closes a kept-alive connection (LiteLLM did, at 16
    concurrent streams) costs that request, counted as bad; the session reconnects."""
    answered = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client is done with this connection
                return
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            answered += 1
            if answered == 2:  # the second request: hang up instead of answering
                writer.close()
                return
            body = b'{"choices": []}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
            if answered == 3:  # the third: answer, then hang up before the next request
                await writer.drain()
                writer.close()
                return

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    out: list[float] = []
    bad: list[int] = []
    request = build_request("/v1/chat/completions", json.dumps(BODY).encode(), {})
    async with server:
        await asyncio.sleep(0)
        await session(port, [request], 5, False, out, bad)
    assert len(out) == 5 and bad == [0, 0]  # the hang-up, and the closed connection found
