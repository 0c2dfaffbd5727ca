"""What the proxy bridge lets a sandbox send: its own session's routes, framed
unambiguously."""

from __future__ import annotations

import pytest

from services.runtimes.bridge import Refused, forbidden, path_allowed, request_framing


@pytest.mark.parametrize(
    ("target", "allowed"),
    [
        (b"/s/ps_tok/v1/chat/completions", True),
        (b"/s/ps_tok/v1beta/models/m:generateContent?alt=sse", True),
        (b"/s/ps_other/v1/chat/completions", False),  # another session's (issue 17)
        (b"/s/ps_TOK/v1/models", False),  # tokens are case-sensitive
        (b"/s/ps_to/v1/models", False),
        (b"/s/ps_tokk/v1/models", False),
        (b"/s/ps%5Ftok/v1/models", False),  # an encoded spelling is not the token
        (b"/s/tok/v1/models", False),  # nor is it without its prefix
        (b"/admin/pause", False),
        (b"/ADMIN/pause", False),
        (b"/metrics", False),
        (b"/v1/chat/completions", False),  # the root routes: not a session's
        (b"/s//v1/models", False),
        (b"/s/ps_tok", False),
        (b"/s/ps_tok/../../admin/pause", False),
        (b"/s/ps_tok/../ps_other/v1/models", False),
        (b"/s/ps_tok/./v1", False),
        (b"/s/ps_tok/%2e%2e/admin", False),
        (b"/s/ps_tok/%2F..%2Fadmin", False),
        (b"http://127.0.0.1:1/admin/pause", False),
    ],
)
def test_only_its_own_session_routes_pass(target, allowed):
    assert path_allowed(target, "ps_tok") is allowed


def test_a_bridge_without_a_token_passes_nothing():
    assert path_allowed(b"/s/ps_tok/v1/models", None) is False
    with pytest.raises(Refused):
        request_framing(head(), None)


def head(*lines: str, target: str = "/s/ps_tok/v1/messages") -> bytes:
    return "\r\n".join([f"POST {target} HTTP/1.1", "host: x", *lines]).encode()


def test_framing_is_read_from_the_headers():
    assert request_framing(head("content-length: 12"), "ps_tok") == ("length", 12)
    assert request_framing(head("Transfer-Encoding: chunked"), "ps_tok") == ("chunked", 0)
    assert request_framing(head(), "ps_tok") == ("length", 0)


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
        request_framing(head(*lines), "ps_tok")


def test_not_http1_and_connect_are_refused():
    with pytest.raises(Refused):
        request_framing(b"PRI * HTTP/2.0", "ps_tok")
    with pytest.raises(Refused):
        request_framing(b"CONNECT 127.0.0.1:6379 HTTP/1.1\r\nhost: x", "ps_tok")


def test_the_refusal_is_an_http_403_with_a_json_reason():
    raw = forbidden("no")
    assert raw.startswith(b"HTTP/1.1 403 Forbidden\r\n") and raw.endswith(b'"message": "no"}}')
