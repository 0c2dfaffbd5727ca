"""The raw HTTP/1.1 response parser, fed bytes as a socket would (no servers)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.io.rawhttp import ProtocolError, ResponseParser

LENGTH = (
    b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"a": [1]} '
)
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n"
)


def parse(*pieces: bytes, head: bool = False) -> ResponseParser:
    parser = ResponseParser(head_request=head)
    for piece in pieces:
        parser.feed(piece)
    return parser


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def test_content_length_body_and_headers():
    p = parse(LENGTH)
    assert p.done and p.status == 200 and p.body == b'{"a": [1]} ' and p.keep_alive
    assert p.headers["content-type"] == "application/json" and not p.leftover


def test_chunked_body_with_extension_and_trailer():
    p = parse(CHUNKED)
    assert p.done and p.body == b"hello, world" and p.keep_alive and not p.leftover


@given(st.sampled_from([LENGTH, CHUNKED]), st.lists(st.integers(0, 400), max_size=8))
def test_any_split_of_the_bytes_parses_the_same(data, cuts):
    whole = parse(data)
    pieces = parse(*split_at(data, cuts))
    assert pieces.done and (pieces.status, pieces.body) == (whole.status, whole.body)


def test_incomplete_body_is_not_done():
    p = parse(LENGTH[:-3])
    assert not p.done and p.started


def test_body_until_close_ends_at_eof_and_is_not_kept_alive():
    p = parse(b"HTTP/1.1 200 OK\r\n\r\npartial", b" body")
    assert not p.done
    p.feed_eof()
    assert p.done and p.body == b"partial body" and not p.keep_alive


def test_connection_close_and_http10_are_not_kept_alive():
    assert not parse(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\ncontent-length: 0\r\n\r\n"
    ).keep_alive
    assert not parse(b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n").keep_alive
    ka = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\ncontent-length: 0\r\n\r\n"
    assert parse(ka).keep_alive


def test_no_body_for_204_and_head_requests():
    assert parse(b"HTTP/1.1 204 No Content\r\n\r\n").body == b""
    p = parse(b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n", head=True)
    assert p.done and p.body == b""


def test_interim_100_continue_is_skipped():
    p = parse(b"HTTP/1.1 100 Continue\r\n\r\n" + LENGTH)
    assert p.done and p.status == 200 and p.body == b'{"a": [1]} '


def test_bytes_past_the_response_mark_it_untrustworthy():
    assert parse(LENGTH + b"HTTP/1.1").leftover


@pytest.mark.parametrize(
    "data",
    [
        b"SMTP ready\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    ],
)
def test_garbage_is_a_protocol_error(data):
    with pytest.raises(ProtocolError):
        parse(data)


def test_oversized_head_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        parse(b"HTTP/1.1 200 OK\r\n" + b"x: y\r\n" * 20000)
