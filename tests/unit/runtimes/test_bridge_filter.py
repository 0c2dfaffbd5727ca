"""What the proxy bridge lets a sandbox send: session routes, framed unambiguously."""

from __future__ import annotations

import pytest

from services.runtimes.bridge import Refused, forbidden, path_allowed, request_framing


@pytest.mark.parametrize(
    ("target", "allowed"),
    [
        (b"/s/ps_tok/v1/chat/completions", True),
        (b"/s/ps_tok/v1beta/models/m:generateContent?alt=sse", True),
        (b"/admin/pause", False),
        (b"/ADMIN/pause", False),
        (b"/metrics", False),
        (b"/v1/chat/completions", False),  # the root routes: not a session's
        (b"/s//v1/models", False),
        (b"/s/tok", False),
        (b"/s/tok/../../admin/pause", False),
        (b"/s/tok/./v1", False),
        (b"/s/tok/%2e%2e/admin", False),
        (b"/s/tok/%2F..%2Fadmin", False),
        (b"http://127.0.0.1:1/admin/pause", False),
    ],
)
def test_only_session_routes_pass(target, allowed):
    assert path_allowed(target) is allowed


def head(*lines: str, target: str = "/s/t/v1/messages") -> bytes:
    return "\r\n".join([f"POST {target} HTTP/1.1", "host: x", *lines]).encode()


def test_framing_is_read_from_the_headers():
    assert request_framing(head("content-length: 12")) == ("length", 12)
    assert request_framing(head("Transfer-Encoding: chunked")) == ("chunked", 0)
    assert request_framing(head()) == ("length", 0)


@pytest.mark.parametrize(
    "lines",
    [
        ("content-length: 5", "transfer-encoding: chunked"),  # request smuggling
        ("content-length: 5", "content-length: 6"),
        ("content-length: -1",),
        ("transfer-encoding: gzip",),
        ("upgrade: h2c", "connection: upgrade"),
    ],
)
def test_ambiguous_or_upgraded_requests_are_refused(lines):
    with pytest.raises(Refused):
        request_framing(head(*lines))


def test_not_http1_and_connect_are_refused():
    with pytest.raises(Refused):
        request_framing(b"PRI * HTTP/2.0")
    with pytest.raises(Refused):
        request_framing(b"CONNECT 127.0.0.1:6379 HTTP/1.1\r\nhost: x")


def test_the_refusal_is_an_http_403_with_a_json_reason():
    raw = forbidden("no")
    assert raw.startswith(b"HTTP/1.1 403 Forbidden\r\n") and raw.endswith(b'"message": "no"}}')
