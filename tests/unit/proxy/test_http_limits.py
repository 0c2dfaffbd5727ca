"""``proxy.io.limits``: the HTTP server's bounds, its connection caps (derived from the
open-files limit), the RFC 9112 checks of a request head; and, in the server
(``proxy.io.native``), the connections past a cap: a 503 for a call, an answer for a
probe, the oldest shed when there are too many of them."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import msgspec
import pytest

from proxy.app import create_app
from proxy.io import limits
from proxy.io.limits import (
    FD_RESERVE,
    MAX_OVERFLOW,
    Admission,
    Caps,
    HttpLimits,
    ThrottledLog,
    connection_caps,
    head_refusal,
)
from proxy.io.native import NativeServer
from proxy.main import ops_routes
from tests.unit.protocols.app_support import CHAT, TOKEN, Scripted, resolve


def test_the_defaults_are_a_deployments() -> None:
    d = HttpLimits()
    assert (d.head_timeout_seconds, d.body_timeout_seconds, d.idle_timeout_seconds) == (30, 30, 300)
    assert d.body_min_bytes_per_second == 1024 and d.max_connections_per_client == 512
    assert d.max_connections == 0  # derived
    assert d.sweep_every == 1.0
    assert HttpLimits(body_timeout_seconds=0.2).sweep_every == 0.05


@pytest.mark.parametrize(
    "bad",
    [
        {"body_timeout_seconds": 0},
        {"head_timeout_seconds": -1},
        {"body_min_bytes_per_second": 0},
        {"max_connections": -1},
        {"nope": 1},
    ],
)
def test_bad_limits_are_refused_at_start(bad) -> None:
    with pytest.raises((ValueError, msgspec.ValidationError)):
        msgspec.convert(bad, HttpLimits)


@pytest.mark.parametrize(
    ("open_files", "total", "overflow"),
    [
        (1024, 384, MAX_OVERFLOW),  # a common soft limit: half of what the reserve leaves
        (1500, 622, MAX_OVERFLOW),
        (20_000, 9872, MAX_OVERFLOW),
        (300, 22, 5),
        (100, 16, 4),  # never below 16
        (1 << 20, limits.MAX_DERIVED_CONNECTIONS, MAX_OVERFLOW),
    ],
)
def test_the_total_cap_leaves_room_under_the_open_files_limit(open_files, total, overflow) -> None:
    caps = connection_caps(HttpLimits(), open_files)
    assert (caps.total, caps.overflow, caps.per_client) == (total, overflow, 512)
    if open_files > 2 * FD_RESERVE:  # each admitted one may hold an engine connection too
        assert 2 * caps.total + caps.overflow + FD_RESERVE // 2 < open_files


def test_a_cap_given_is_used_as_is() -> None:
    caps = connection_caps(HttpLimits(max_connections=10, max_connections_per_client=0), 1024)
    assert (caps.total, caps.per_client) == (10, 0)


def test_admission_counts_per_client_and_in_total() -> None:
    admission = Admission(Caps(total=3, per_client=2, overflow=4))
    assert [admission.admit("a") for _ in range(3)] == [None, None, "per_client"]
    assert admission.admit("b") is None
    assert admission.admit("c") == "total"
    admission.release("a")
    assert admission.admit("c") is None
    assert admission.per_client == {"a": 1, "b": 1, "c": 1}


def test_a_flood_of_warnings_is_one_line_per_interval(caplog, monkeypatch) -> None:
    now = [0.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: now[0])
    throttled = ThrottledLog()
    with caplog.at_level(logging.WARNING, "polar.proxy"):
        for _ in range(100):
            throttled.warn("total", "refused %s", "x")
        now[0] = limits.LOG_EVERY_S + 1
        throttled.warn("total", "refused %s", "y")
    assert [r.getMessage() for r in caplog.records] == [
        "refused x",
        "refused y (+99 more since the last such line)",
    ]


@pytest.mark.parametrize(
    ("version", "headers", "hosts", "status"),
    [
        ("1.1", {"host": "t"}, 1, None),
        ("1.0", {}, 0, None),  # HTTP/1.0 needs no Host
        ("2.0", {"host": "t"}, 1, 505),
        ("0.9", {}, 0, 505),
        ("1.1", {}, 0, 400),
        ("1.1", {"host": "t, u"}, 2, 400),
        ("1.1", {"host": "t", "transfer-encoding": "chunked"}, 1, None),
        ("1.1", {"host": "t", "transfer-encoding": "Chunked"}, 1, None),
        ("1.1", {"host": "t", "transfer-encoding": "xchunked"}, 1, 501),
        ("1.1", {"host": "t", "transfer-encoding": "gzip, chunked"}, 1, 501),
        ("1.1", {"host": "t", "transfer-encoding": "chunked, chunked"}, 1, 400),
        ("1.0", {"transfer-encoding": "chunked"}, 0, 400),
    ],
)
def test_rfc_9112_head_rules(version, headers, hosts, status) -> None:
    refusal = head_refusal(version, headers, hosts)
    assert (refusal[0] if refusal else None) == status


# ---------------------------------------------------------------- past the caps, in the server

PATH = f"/s/{TOKEN}{CHAT[0]}"
BODY = json.dumps(CHAT[1]).encode()
CALL = f"POST {PATH} HTTP/1.1\r\nhost: t\r\ncontent-length: {len(BODY)}\r\n\r\n".encode() + BODY


async def _health() -> dict[str, object]:
    return {}


@pytest.fixture
async def capped() -> AsyncIterator[tuple[NativeServer, int]]:
    """Two connections at most, four past the cap held (open files: the reserve + 32)."""
    app = create_app(Scripted().prepare, resolve, operator_routes=ops_routes("t", _health))
    await app.startup()
    server = NativeServer(
        app,
        asyncio.get_running_loop(),
        HttpLimits(max_connections=2, head_timeout_seconds=30),
        open_files=FD_RESERVE + 32,
    )
    assert server.caps.overflow == 4
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.stop(drain_timeout=1.0)
        await app.shutdown()


async def status_of(reader: asyncio.StreamReader) -> int:
    line = await asyncio.wait_for(reader.readline(), 30)
    assert line, "closed without a response"
    return int(line.split()[1])


async def test_past_the_cap_a_call_is_a_503_and_a_probe_is_answered(capped) -> None:
    server, port = capped
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(CALL)
    assert await status_of(reader) == 503
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")
    assert await status_of(reader) == 200
    for _, w in held:
        w.close()


async def test_the_oldest_connection_past_the_cap_is_shed_for_a_newer_one(capped) -> None:
    server, port = capped
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2 + 4)]
    oldest_over = held[2][0]
    newest = await asyncio.open_connection("127.0.0.1", port)  # a fifth past the cap
    assert await status_of(oldest_over) == 503
    await asyncio.wait_for(oldest_over.read(), 30)  # the rest of the 503, then closed
    newest[1].write(b"GET /metrics HTTP/1.1\r\nhost: t\r\n\r\n")
    assert await status_of(newest[0]) == 200  # still a place for a probe
    for _, w in [*held, newest]:
        w.close()
