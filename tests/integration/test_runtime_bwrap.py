"""The local runtime under bubblewrap (needs the `bubblewrap` Debian package: `just setup`
installs it as root with apt; without it these tests skip, saying so).

With `network: none` the sandbox reaches the proxy only through the Unix-socket bridge,
and there only its own session's routes (the token the runtime was created or adopted
with): a stand-in proxy HTTP server answers through it, while another server on the node's
loopback, the node's other addresses, host Unix sockets under /run and the outside world
stay unreachable. The same probe with `network: host` reaches the other server (the
positive control that shows the probe can see an open port).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from schemas.task import LocalRuntime
from services.runtimes import adopt_runtime, create_runtime
from tests.helpers.requires import requires_bwrap
from tests.unit.runtimes.support import FORKING_HARNESS, free_port, leftovers

pytestmark = requires_bwrap

PROBE = r"""
import socket, sys, urllib.request
proxy_url, forbidden_port, node_ip, run_socket = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
print("PROXY", urllib.request.urlopen(proxy_url + "/v1/models", timeout=5).read().decode())
targets = [("127.0.0.1", forbidden_port), (node_ip, forbidden_port), ("1.1.1.1", 80)]
for host, port in targets:
    try:
        socket.create_connection((host, port), timeout=2).close()
        print("OPEN", host, port)
    except OSError as exc:
        print("BLOCKED", host, port, exc.__class__.__name__)
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(run_socket)
    print("OPEN", run_socket)
except OSError as exc:
    print("BLOCKED", run_socket, exc.__class__.__name__)
"""


def _exists(path: str | Path) -> bool:
    return Path(path).exists()


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


async def _http_server(body: bytes, hits: list[str]) -> tuple[asyncio.AbstractServer, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        hits.append(request.split(b" ")[1].decode())
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (len(body), body))  # fmt: skip
        await writer.drain()
        writer.close()

    port = free_port()
    return await asyncio.start_server(handle, "127.0.0.1", port), port


def _node_ip() -> str:
    """A non-loopback address of this node (routing lookup only, no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.2"


@pytest.fixture
async def servers():
    proxy_hits: list[str] = []
    other_hits: list[str] = []
    proxy, proxy_port = await _http_server(b"proxy-ok", proxy_hits)
    other, other_port = await _http_server(b"other", other_hits)
    other_wide = await asyncio.start_server(lambda r, w: w.close(), _node_ip(), other_port)
    run_path = Path(f"/run/polar-bwrap-test-{secrets.token_hex(4)}.sock")
    run_server = await asyncio.start_unix_server(lambda r, w: w.close(), path=str(run_path))
    yield proxy_port, other_port, proxy_hits, other_hits, str(run_path)
    for server in (proxy, other, other_wide, run_server):
        server.close()
    _remove(run_path)


async def _probe(rt, other_port: int, run_socket: str) -> list[str]:
    args = [rt.proxy_url, str(other_port), _node_ip(), run_socket]
    r = await rt.exec([sys.executable, "-I", "-c", PROBE, *args], timeout=30)
    assert r.exit_code == 0, r.stderr.decode()
    return r.stdout.decode().splitlines()


async def test_network_none_reaches_only_the_proxy_through_the_bridge(servers, tmp_path):
    proxy_port, other_port, proxy_hits, other_hits, run_socket = servers
    spec = LocalRuntime(sandbox="bwrap", network="none")
    rt = create_runtime(
        spec,
        "bw-1",
        base_dir=tmp_path,
        proxy_url=f"http://127.0.0.1:{proxy_port}/s/tok",
        token="tok",
    )
    async with rt:
        assert rt.proxy_url == f"http://127.0.0.1:{proxy_port}/s/tok"
        lines = await _probe(rt, other_port, run_socket)
    node_ip = _node_ip()
    assert lines[0] == "PROXY proxy-ok"
    assert proxy_hits == ["/s/tok/v1/models"]
    assert lines[1].startswith(f"BLOCKED 127.0.0.1 {other_port} ConnectionRefusedError")
    assert lines[2].startswith(f"BLOCKED {node_ip} {other_port}")
    assert lines[3].startswith("BLOCKED 1.1.1.1 80")
    assert lines[4] == f"BLOCKED {run_socket} FileNotFoundError"
    assert other_hits == []


async def test_the_default_network_is_isolated_and_a_step_may_ask_for_the_nodes(servers, tmp_path):
    """A local runtime that names no network (``auto``) under bubblewrap is isolated as
    ``none`` is (it was ``host`` before issue 33: every port of the node in reach); a
    command run with ``network=True`` (a prepare step that installs) gets the node's."""
    proxy_port, other_port, proxy_hits, other_hits, run_socket = servers
    assert LocalRuntime().network == "auto"
    url = f"http://127.0.0.1:{proxy_port}/s/tok"
    rt = create_runtime(LocalRuntime(sandbox="bwrap"), "bw-5", base_dir=tmp_path,
                        proxy_url=url, token="tok")  # fmt: skip
    async with rt:
        isolated = await _probe(rt, other_port, run_socket)
        step = await rt.exec(
            [sys.executable, "-I", "-c", PROBE, url, str(other_port), _node_ip(), run_socket],
            timeout=30,
            network=True,
        )
    assert isolated[0] == "PROXY proxy-ok"  # through the bridge
    assert isolated[1].startswith(f"BLOCKED 127.0.0.1 {other_port}"), isolated
    assert step.stdout.decode().splitlines()[1] == f"OPEN 127.0.0.1 {other_port}"


async def test_host_network_control_reaches_the_other_server(servers, tmp_path):
    proxy_port, other_port, _, _, run_socket = servers
    spec = LocalRuntime(sandbox="bwrap", network="host")
    rt = create_runtime(spec, "bw-2", base_dir=tmp_path, proxy_url=f"http://127.0.0.1:{proxy_port}")
    async with rt:
        lines = await _probe(rt, other_port, run_socket)
    assert lines[0] == "PROXY proxy-ok"
    assert lines[1] == f"OPEN 127.0.0.1 {other_port}"


async def test_host_is_read_only_workdir_writable_tmp_and_pids_private(tmp_path):
    (tmp_path / "host-only.txt").write_text("node /tmp file")
    rt = create_runtime(LocalRuntime(sandbox="bwrap"), "bw-3", base_dir=tmp_path)
    async with rt:
        ro = await rt.exec("touch /etc/polar-x")
        rw = await rt.exec("echo data > out.txt && echo t > /tmp/t && cat out.txt /tmp/t")
        hidden = await rt.exec(f"test -e {tmp_path}/host-only.txt")
        pids = await rt.exec("ls /proc | grep -c '^[0-9]'")
        caps = await rt.exec("grep CapEff /proc/self/status")
        visible = await rt.exec(f"kill -0 {os.getpid()}")
        assert await rt.download("out.txt") == b"data\n"
    assert ro.exit_code == 1 and b"Read-only file system" in ro.stderr
    assert rw.stdout == b"data\nt\n"
    assert hidden.exit_code == 1  # the node's /tmp is not the sandbox's /tmp
    assert int(pids.stdout) <= 5  # only the sandbox's own processes
    assert caps.stdout.decode().split() == ["CapEff:", "0000000000000000"]
    assert visible.exit_code != 0  # the test process is invisible inside
    assert not _exists("/etc/polar-x")


async def test_timeout_kills_forked_children_inside_bwrap(tmp_path):
    rt = create_runtime(LocalRuntime(sandbox="bwrap"), "bw-4", base_dir=tmp_path)
    async with rt:
        started = time.monotonic()
        # 3 s: time for a loaded machine to start bwrap and fork the three before the kill
        r = await rt.exec(FORKING_HARNESS, timeout=3.0, grace=0.3)
        assert r.timed_out and r.stdout == b"forked\n" and time.monotonic() - started < 8
        assert leftovers(rt.runtime_id) == []


async def test_killing_bwrap_alone_takes_the_whole_sandbox_down(tmp_path):
    rt = create_runtime(LocalRuntime(sandbox="bwrap"), "bw-5", base_dir=tmp_path)
    async with rt:
        proc = await rt.spawn(
            "setsid sleep 1000 & sleep 1000 & echo up; wait", stdout=lambda b: None
        )
        while len(leftovers(rt.runtime_id)) < 3:
            await asyncio.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)  # only bwrap itself: no sweep, no killpg
        deadline = time.monotonic() + 10  # the kernel's, not a timer's: load only delays it
        while leftovers(rt.runtime_id) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert leftovers(rt.runtime_id) == []


async def test_cancel_during_exec_leaves_nothing(servers, tmp_path):
    proxy_port = servers[0]
    spec = LocalRuntime(sandbox="bwrap", network="none")
    rt = create_runtime(spec, "bw-6", base_dir=tmp_path, proxy_url=f"http://127.0.0.1:{proxy_port}")
    await rt.start()
    bridge_dir = rt.bridge_dir
    assert bridge_dir is not None and (bridge_dir / "proxy.sock").is_socket()
    running = asyncio.create_task(rt.exec(FORKING_HARNESS, timeout=60))
    while not (tmp_path / "bw-6-a0-main/workdir/pids").exists():
        await asyncio.sleep(0.02)
    await rt.cancel()
    with pytest.raises(Exception, match="stopped during exec"):
        await running
    assert leftovers(rt.runtime_id) == []
    assert not (tmp_path / "bw-6-a0-main").exists()
    assert not bridge_dir.exists()


async def test_an_adopter_brings_its_own_bridge(servers, tmp_path):
    proxy_port, other_port, proxy_hits, _, run_socket = servers
    spec = LocalRuntime(sandbox="bwrap", network="none")
    url = f"http://127.0.0.1:{proxy_port}/s/tok"
    pool_side = create_runtime(spec, "bw-7", base_dir=tmp_path, proxy_url=url, token="tok")
    await pool_side.start()
    pool_bridge = pool_side.bridge_dir
    await pool_side.detach()
    assert pool_bridge is not None and not pool_bridge.exists()
    executor_side = adopt_runtime(
        spec, "bw-7", "bw-7-a0-main", base_dir=tmp_path, proxy_url=url, token="tok"
    )
    lines = await _probe(executor_side, other_port, run_socket)
    assert lines[0] == "PROXY proxy-ok" and lines[1].startswith("BLOCKED")
    # the adopter's bridge is pinned to the session's token too (issue 17)
    other = await executor_side.exec(
        [sys.executable, "-I", "-c", STATUS, executor_side.proxy_url.replace("/s/tok", "/s/ps_x")]
    )
    assert other.stdout.decode().strip() == "403", other.stderr.decode()
    assert proxy_hits == ["/s/tok/v1/models"]
    await executor_side.stop()
    assert not (tmp_path / "bw-7-a0-main").exists() and executor_side.bridge_dir is None


STATUS = r"""
import sys, urllib.error, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1] + "/v1/models", timeout=5).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""

ADMIN_PROBE = r"""
import sys, urllib.error, urllib.request
root = sys.argv[1]  # the proxy's root as the sandbox sees it (127.0.0.1:<port>)
for method, path in [
    ("POST", "/admin/pause"),
    ("GET", "/admin/weight_version"),
    ("POST", "/admin/flush_cache"),
    ("GET", "/metrics"),
    ("POST", "/s/tok/../../admin/pause"),
    ("POST", "/s/tok/%2e%2e/admin/pause"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/s/ps_another_session/v1/models"),  # a leaked token of another session
    ("POST", "/s/TOK/v1/chat/completions"),
]:
    req = urllib.request.Request(root + path, data=b"{}" if method == "POST" else None, method=method)
    try:
        code = urllib.request.urlopen(req, timeout=5).status
    except urllib.error.HTTPError as exc:
        code = exc.code
    print(method, path, code)
"""


async def test_the_bridge_refuses_everything_but_its_sessions_routes(servers, tmp_path):
    """Issue 17: /admin/pause answered 200 through the bridge of a network-less sandbox,
    and so did any other session's routes."""
    proxy_port, _, proxy_hits, _, _ = servers
    spec = LocalRuntime(sandbox="bwrap", network="none")
    rt = create_runtime(
        spec, "bw-adm", base_dir=tmp_path, proxy_url=f"http://127.0.0.1:{proxy_port}", token="tok"
    )
    async with rt:
        r = await rt.exec([sys.executable, "-I", "-c", ADMIN_PROBE, rt.proxy_url], timeout=30)
        assert r.exit_code == 0, r.stderr.decode()
        ok = await rt.exec(
            [
                sys.executable,
                "-I",
                "-c",
                PROBE.split("\ntargets")[0],
                rt.proxy_url + "/s/tok",
                "1",
                "x",
                "y",
            ],
            timeout=30,
        )
    codes = [line.rsplit(" ", 1)[1] for line in r.stdout.decode().splitlines()]
    assert codes == ["403"] * 9, r.stdout.decode()
    assert ok.stdout.decode().strip() == "PROXY proxy-ok"  # a session route still passes
    assert proxy_hits == ["/s/tok/v1/models"]  # nothing else reached the proxy
