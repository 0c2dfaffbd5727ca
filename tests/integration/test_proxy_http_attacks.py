"""The proxy's HTTP server under a hostile client (issue 33, items 3 and 4), against the
real server: ``serve_native`` in its own process (uvloop), the real proxy app with a
scripted model, short timeouts so a test need not wait 30 s; and the sandbox bridge in
front of it.

Each shape of request gets its status (400 malformed framing or no Host, 408 a body too
slow, 501 an unknown transfer coding, 503 past a connection cap, 505 a version other than
HTTP/1.0 and 1.1), trailers never become headers, a valid request pipelined before
garbage gets its answer first, and afterwards the server still serves and the
connections' file descriptors are released. The tests wait on events (a response, a
closed socket, a count reaching its value), never on how long something took.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httptools
import msgspec
import pytest

from infra import localservers
from proxy.io.limits import HttpLimits, head_refusal
from services.runtimes import bridge as bridge_module
from services.runtimes.bridge import ProxyBridge, Refused, request_framing
from tests.integration.proxy_sdk_app import TOKEN

REPO = Path(__file__).resolve().parents[2]
WAIT = 60.0  # for an event that should come within a second or two: generous, CI is loaded
CHAT = f"/s/{TOKEN}/v1/chat/completions"
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
SLOW_BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "pause"}]}).encode()

# short bounds: every timeout here is 2 s, so a test sees it fire soon (a request a test
# means to be whole is sent in one write, long before)
SHORT = HttpLimits(
    head_timeout_seconds=2.0,
    body_timeout_seconds=2.0,
    body_min_bytes_per_second=1024,
    idle_timeout_seconds=30.0,
    max_connections_per_client=0,
)
# long bounds, small caps: held connections stay held while a test looks at the caps
CAPPED = HttpLimits(
    head_timeout_seconds=120.0,
    body_timeout_seconds=120.0,
    idle_timeout_seconds=120.0,
    max_connections=40,
    max_connections_per_client=20,
)


def make_app():  # serve_native's factory in the server process
    from tests.integration.proxy_sdk_app import make_app as sdk_app

    app = sdk_app()
    app.http_limits = msgspec.json.decode(os.environ["POLAR_TEST_HTTP_LIMITS"], type=HttpLimits)
    return app


@dataclass
class Served:
    port: int
    pid: int
    log: Path

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))


def serve(limits: HttpLimits, log: Path) -> Iterator[Served]:
    port = localservers.free_port()
    target = "tests.integration.test_proxy_http_attacks:make_app"
    code = (
        f"from proxy.io.native import serve_native; serve_native({target!r}, '127.0.0.1', {port})"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "POLAR_TEST_HTTP_LIMITS": msgspec.json.encode(limits).decode(),
        "POLAR_TEST_MARKERS": str(log.parent),
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_up(port, proc, log)
        yield Served(port, proc.pid, log)
    finally:
        localservers.stop_process(proc.pid)
        proc.wait(10)


def _wait_up(port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"proxy exited: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(get("/healthz"))
                if sock.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"proxy not up: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def short(tmp_path_factory) -> Iterator[Served]:
    yield from serve(SHORT, tmp_path_factory.mktemp("short") / "proxy.log")


@pytest.fixture(scope="module")
def capped(tmp_path_factory) -> Iterator[Served]:
    yield from serve(CAPPED, tmp_path_factory.mktemp("capped") / "proxy.log")


# ---------------------------------------------------------------- raw HTTP


def get(path: str) -> bytes:
    """The server closes the connection after its answer: it is released before the
    server accepts the test's next connection (nothing of the test's own lingers in the
    caps' counts)."""
    return f"GET {path} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n".encode()


def post(body: bytes = BODY, path: str = CHAT, extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
    return f"{head}content-length: {len(body)}\r\n{extra}\r\n".encode() + body


def chunked(body: bytes = BODY, path: str = CHAT, te: str = "chunked", trailer: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: {te}\r\n\r\n".encode()
    return head + b"%x\r\n%b\r\n0\r\n%b\r\n" % (len(body), body, trailer.encode())


async def connect(port: int, source: str = "127.0.0.1"):
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response (interim ones skipped): status, headers, sized body."""
    return await asyncio.wait_for(_read_response(reader), WAIT)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status_line = await reader.readline()
    assert status_line, "the connection closed without a response"
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if status == 100:
        return await _read_response(reader)
    return status, headers, await reader.readexactly(int(headers.get("content-length", 0)))


async def closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), WAIT) == b""


async def call(port: int, request: bytes, source: str = "127.0.0.1"):
    reader, writer = await connect(port, source)
    try:
        writer.write(request)
        return await read_response(reader)
    finally:
        writer.close()


async def metric(port: int, name: str, labels: str = "") -> float:
    status, _, body = await call(port, get("/metrics"))
    assert status == 200
    found = re.search(rf"^{re.escape(name + labels)} (\S+)$", body.decode(), re.M)
    return float(found[1]) if found else 0.0


async def fds_back_to(served: Served, baseline: int) -> int:
    """The server's descriptors once they are down to ``baseline`` (or ``WAIT`` is up)."""
    deadline = time.monotonic() + WAIT
    while (n := served.fds()) > baseline and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return n


async def still_serving(served: Served) -> None:
    status, _, body = await call(served.port, post())
    assert status == 200 and json.loads(body)["choices"]


async def settled_fds(served: Served) -> int:
    """The server's descriptors once the connections just closed are gone: the lowest
    count over a few looks."""
    counts = []
    for _ in range(5):
        counts.append(served.fds())
        await asyncio.sleep(0.05)
    return min(counts)


@pytest.fixture
async def baseline(short) -> int:
    await still_serving(short)  # warm: whatever the first call opens is open
    return await settled_fds(short)


# ---------------------------------------------------------------- item 4: RFC 9112


SHAPES = {
    "bad-chunk-size": (
        f"POST {CHAT} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhi\r\n0\r\n\r\n",
        400,
    ),
    "chunk-size-over-64-bits": (
        f"POST {CHAT} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n1ffffffffffffffff\r\n",
        400,
    ),
    "unknown-coding": (chunked(te="xchunked").decode(), 501),
    "gzip-then-chunked": (chunked(te="gzip, chunked").decode(), 501),
    "content-length-in-trailers": (chunked(trailer="content-length: 5\r\n").decode(), 400),
    "chunked-in-http-1.0": (chunked().decode().replace("HTTP/1.1", "HTTP/1.0", 1), 400),
    "length-and-chunked": (
        f"POST {CHAT} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n"
        "0\r\n\r\n",
        400,
    ),
    "two-lengths": (post().decode().replace("\r\n\r\n", "\r\ncontent-length: 2\r\n\r\n", 1), 400),
    "folded-header": (post(extra="x-a: b\r\n content-length: 2\r\n").decode(), 400),
    "space-before-colon": (post(extra="x-a : b\r\n").decode(), 400),
    "http-2.0": ("GET /healthz HTTP/2.0\r\nhost: t\r\n\r\n", 505),
    "http-0.9": ("GET /healthz\r\n\r\n", 505),
    "no-host": ("GET /healthz HTTP/1.1\r\n\r\n", 400),
    "two-hosts": ("GET /healthz HTTP/1.1\r\nhost: t\r\nhost: u\r\n\r\n", 400),
}


@pytest.mark.parametrize(("request_text", "status"), SHAPES.values(), ids=SHAPES.keys())
async def test_each_malformed_shape_gets_its_status_and_the_server_serves_on(
    short, baseline, request_text, status
) -> None:
    reader, writer = await connect(short.port)
    writer.write(request_text.encode("latin-1"))
    got, headers, body = await read_response(reader)
    assert (got, headers["connection"]) == (status, "close")
    assert json.loads(body)["error"]["message"]
    assert await closed(reader)
    writer.close()
    await still_serving(short)
    assert await fds_back_to(short, baseline) <= baseline


async def test_http_1_0_without_host_is_still_answered(short) -> None:
    status, _, _ = await call(short.port, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert status == 200


async def test_trailers_never_become_headers(short) -> None:
    """A root-path call whose token is only in a trailer has no token (RFC 9110 6.5)."""
    trailer = f"authorization: Bearer {TOKEN}\r\n"
    status, _, body = await call(short.port, chunked(path="/v1/chat/completions", trailer=trailer))
    assert status == 401, body
    # the same token as a header is a call
    head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\nauthorization: Bearer {TOKEN}\r\n"
    status, _, _ = await call(
        short.port, f"{head}content-length: {len(BODY)}\r\n\r\n".encode() + BODY
    )
    assert status == 200


@pytest.mark.parametrize(
    ("garbage", "status"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"GET /healthz HTTP/2.0\r\nhost: t\r\n\r\n", 505),
        (b"GET /healthz HTTP/1.1\r\n\r\n", 400),
        (chunked(te="xchunked"), 501),
        (SHAPES["bad-chunk-size"][0].encode(), 400),
    ],
    ids=["garbage", "http-2.0", "no-host", "unknown-coding", "bad-chunk-size"],
)
async def test_a_valid_request_pipelined_before_garbage_is_answered_first(
    short, garbage, status
) -> None:
    """A slow call, a quick one, then garbage, in one write: 200, 200, then the
    garbage's error, then the connection closes."""
    reader, writer = await connect(short.port)
    writer.write(post(SLOW_BODY) + post() + garbage)
    answers = [await read_response(reader) for _ in range(3)]
    assert [a[0] for a in answers] == [200, 200, status]
    assert answers[2][1]["connection"] == "close"
    assert await closed(reader)
    writer.close()


# ---------------------------------------------------------------- item 3: held connections


async def test_a_body_announced_and_never_sent_is_a_408(short, baseline) -> None:
    for path in (CHAT, "/s/not-a-token/v1/chat/completions"):
        reader, writer = await connect(short.port)
        writer.write(post(path=path)[: -len(BODY)])  # the head, and no body
        status, headers, _ = await read_response(reader)
        assert (status, headers["connection"]) == (408, "close")
        assert await closed(reader)
        writer.close()
    assert await fds_back_to(short, baseline) <= baseline


async def test_a_trickled_body_is_cut_off(short, baseline) -> None:
    """One byte at a time, far below the minimum rate: a 408 once the grace is over."""
    reader, writer = await connect(short.port)
    request = post()
    writer.write(request[: -len(BODY)])

    async def trickle() -> None:
        for byte in BODY:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.1)

    trickling = asyncio.ensure_future(trickle())
    try:
        status, _, _ = await read_response(reader)
    finally:
        trickling.cancel()
    assert status == 408
    assert await closed(reader)
    writer.close()
    assert await fds_back_to(short, baseline) <= baseline


async def test_a_chunk_of_2_to_the_64_minus_1_bytes_is_cut_off(short) -> None:
    reader, writer = await connect(short.port)
    head = f"POST {CHAT} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
    writer.write(head.encode() + b"ffffffffffffffff\r\nhello")
    assert (await read_response(reader))[0] == 408
    assert await closed(reader)
    writer.close()


async def test_a_head_that_never_ends_and_a_silent_connection_are_closed(short) -> None:
    silent_reader, silent = await connect(short.port)
    reader, writer = await connect(short.port)
    writer.write(f"POST {CHAT} HTTP/1.1\r\nhost: t\r\n".encode())
    assert await closed(reader)
    assert await closed(silent_reader)
    writer.close()
    silent.close()


async def test_100_continue_is_sent_only_to_a_valid_token(short) -> None:
    head = post(extra="expect: 100-continue\r\n")[: -len(BODY)]
    # an unknown token: the final answer at once, no 100 Continue, the body never asked for
    reader, writer = await connect(short.port)
    writer.write(head.replace(TOKEN.encode(), b"not-a-token"))
    first = await asyncio.wait_for(reader.readline(), WAIT)
    assert first.split()[1] == b"401", first
    writer.close()
    # a valid token: 100 Continue, then the answer to the body
    reader, writer = await connect(short.port)
    writer.write(head)
    assert await asyncio.wait_for(reader.readline(), WAIT) == b"HTTP/1.1 100 Continue\r\n"
    assert await reader.readline() == b"\r\n"
    writer.write(BODY)
    assert (await read_response(reader))[0] == 200
    # and a body never sent after the 100: a 408
    writer.write(head)
    assert (await read_response(reader))[0] == 408
    writer.close()


async def test_refusals_are_counted_in_metrics(short) -> None:
    async def counts() -> list[float]:
        label = 'polar_proxy_http_refused_total{status="%s"}'
        return [await metric(short.port, label % s) for s in ("400", "408", "501", "505")]

    before = await counts()
    for request_text, _ in (SHAPES["no-host"], SHAPES["unknown-coding"], SHAPES["http-2.0"]):
        await call(short.port, request_text.encode())
    await call(short.port, post()[: -len(BODY)])  # 408
    after = await counts()
    assert all(b - a >= 1 for a, b in zip(before, after, strict=True)), (before, after)


# ---------------------------------------------------------------- item 3: connection caps


async def hold(port: int, source: str, n: int) -> list[tuple]:
    """``n`` unauthenticated connections that hold: half send a head that never ends,
    half announce a body and never send it."""
    held = []
    for i in range(n):
        reader, writer = await connect(port, source)
        writer.write(post(path="/s/x/v1/chat/completions")[: -len(BODY) - (2 if i % 2 else 0)])
        held.append((reader, writer))
    return held


async def open_connections_reach(served: Served, n: int) -> float:
    deadline = time.monotonic() + WAIT
    while (got := await metric(served.port, "polar_proxy_open_connections")) < n:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    return got


async def test_held_connections_past_the_caps_get_a_503_and_probes_still_answer(capped) -> None:
    port = capped.port
    call_once = post(extra="connection: close\r\n")  # released before the next is accepted
    await call(port, get("/healthz"))
    baseline = await settled_fds(capped)
    over = 'polar_proxy_connections_over_cap_total{cap="%s"}'
    before = {cap: await metric(port, over % cap) for cap in ("per_client", "total")}
    # one client address holds its 20: its 21st is refused, others are served
    held = await hold(port, "127.0.0.2", CAPPED.max_connections_per_client)
    assert await open_connections_reach(capped, 21) >= 21  # 20 and the /metrics one
    assert capped.fds() >= baseline + 20
    status, headers, _ = await call(port, call_once, source="127.0.0.2")
    assert (status, headers["connection"], headers["retry-after"]) == (503, "close", "1")
    assert (await call(port, get("/healthz"), source="127.0.0.2"))[0] == 200  # a probe
    assert (await call(port, call_once))[0] == 200  # another address
    # a second address fills the total: now everyone's call is a 503, probes still answer
    held += await hold(port, "127.0.0.3", CAPPED.max_connections - 20)
    assert await open_connections_reach(capped, 41) >= 41
    assert (await call(port, call_once))[0] == 503
    assert (await call(port, get("/healthz")))[0] == 200
    after = {cap: await metric(port, over % cap) for cap in ("per_client", "total")}
    assert after["per_client"] > before["per_client"] and after["total"] > before["total"]
    log = capped.log.read_text()
    assert "past the per-client cap" in log and "past the total cap" in log
    # the attackers leave: every descriptor is given back, and calls are served again
    for _, writer in held:
        writer.close()
    assert await fds_back_to(capped, baseline) <= baseline
    assert (await call(port, post()))[0] == 200


# ---------------------------------------------------------------- the bridge agrees


def llhttp_framing(head: bytes) -> tuple[str, int] | None:
    """How the proxy frames a request head's body: ("length", n), ("chunked", 0), or
    None when it refuses the head."""

    class Head:
        headers: dict[str, str]
        hosts = 0

        def __init__(self) -> None:
            self.headers, self.done = {}, False

        def on_header(self, name: bytes, value: bytes) -> None:
            key = name.decode("latin-1").lower()
            self.hosts += key == "host"
            old = self.headers.get(key)
            text = value.decode("latin-1")
            self.headers[key] = text if old is None else f"{old}, {text}"

        def on_headers_complete(self) -> None:
            self.done = True

    seen = Head()
    parser = httptools.HttpRequestParser(seen)
    try:
        parser.feed_data(head + b"\r\n\r\n")
    except httptools.HttpParserError:
        return None
    if not seen.done or head_refusal(parser.get_http_version(), seen.headers, seen.hosts):
        return None
    if "transfer-encoding" in seen.headers:
        return "chunked", 0
    return "length", int(seen.headers.get("content-length", 0))


BRIDGE_HEADS = {
    "plain": ["content-length: 12"],
    "chunked": ["Transfer-Encoding: chunked"],
    "folded-length": ["x-a: b", " content-length: 5"],
    "tab-folded": ["x-a: b", "\tcontent-length: 5"],
    "space-before-colon": ["content-length : 5"],
    "bare-lf": ["x-a: b\ncontent-length: 5"],
    "bare-cr": ["x-a: b\rcontent-length: 5"],
    "nul-in-value": ["x-a: b\x00c"],
    "two-equal-lengths": ["content-length: 5", "content-length: 5"],
    "length-list": ["content-length: 5, 5"],
    "plus-length": ["content-length: +5"],
    "chunked-twice": ["transfer-encoding: chunked", "transfer-encoding: chunked"],
    "chunked-list": ["transfer-encoding: chunked, chunked"],
    "xchunked": ["transfer-encoding: xchunked"],
    "no-colon": ["content-length 5"],
}


@pytest.mark.parametrize("lines", BRIDGE_HEADS.values(), ids=BRIDGE_HEADS.keys())
@pytest.mark.parametrize("version", ["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.2"])
def test_the_bridge_frames_a_head_as_the_proxy_does_or_refuses_it(lines, version) -> None:
    head = "\r\n".join([f"POST {CHAT} {version}", "host: t", *lines]).encode("latin-1")
    try:
        bridge = request_framing(head, TOKEN)
    except Refused as refused:
        assert refused.status in (400, 403)
        return
    assert bridge == llhttp_framing(head), "the bridge forwards a body the proxy frames otherwise"


@pytest.fixture
async def sandbox_bridge(short, tmp_path) -> AsyncIterator[ProxyBridge]:
    proxy_bridge = ProxyBridge(tmp_path / "proxy.sock", ("127.0.0.1", short.port), TOKEN)
    await proxy_bridge.start()
    try:
        yield proxy_bridge
    finally:
        await proxy_bridge.close()


@pytest.fixture
def bridge(sandbox_bridge) -> Path:
    return sandbox_bridge.socket_path


async def through_bridge(path: Path, request: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        writer.write(request)
        return await read_response(reader)
    finally:
        writer.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        # obs-fold: the bridge used to read it as the body's length
        f"POST {CHAT} HTTP/1.1\r\nhost: t\r\nx-a: b\r\n content-length: 5\r\n\r\nhello".encode(),
        post(extra="x-a : b\r\n"),
        SHAPES["bad-chunk-size"][0].encode(),
        chunked().replace(b"%x\r\n" % len(BODY), b"0x%x\r\n" % len(BODY)),  # int(_, 16) reads it
        chunked().replace(b"%x\r\n" % len(BODY), b"+%x\r\n" % len(BODY)),
        chunked().replace(b"\r\n0\r\n", b"XX0\r\n"),  # a chunk longer than its size
    ],
    ids=["folded", "space-before-colon", "bad-chunk", "0x-chunk", "plus-chunk", "long-chunk"],
)
async def test_the_bridge_refuses_what_it_cannot_frame_and_forwards_nothing(
    bridge, request_bytes
) -> None:
    status, _, body = await through_bridge(bridge, request_bytes)
    assert status == 400
    assert json.loads(body)["error"]["message"].startswith("proxy bridge: ")  # its own
    assert (await through_bridge(bridge, post()))[0] == 200


async def test_the_bridge_lets_go_once_the_proxy_closes(short, sandbox_bridge, baseline) -> None:
    """A sandbox that announces a body and never sends it, and keeps its side open: the
    proxy's 408 comes back through the bridge, which then lets the connection go (its
    descriptors with it) without waiting for the sandbox."""
    reader, writer = await asyncio.open_unix_connection(str(sandbox_bridge.socket_path))
    writer.write(post()[: -len(BODY)])
    assert (await read_response(reader))[0] == 408
    assert await closed(reader)
    deadline = time.monotonic() + WAIT
    while sandbox_bridge._conns and time.monotonic() < deadline:  # noqa: SLF001
        await asyncio.sleep(0.05)
    assert not sandbox_bridge._conns  # noqa: SLF001
    assert await fds_back_to(short, baseline) <= baseline
    writer.close()


async def test_the_bridge_holds_a_few_connections_per_sandbox(bridge, monkeypatch) -> None:
    monkeypatch.setattr(bridge_module, "MAX_CONNECTIONS", 2)
    held = [await asyncio.open_unix_connection(str(bridge)) for _ in range(2)]
    status, headers, _ = await through_bridge(bridge, post())
    assert (status, headers["connection"]) == (503, "close")
    for _, writer in held:
        writer.close()
