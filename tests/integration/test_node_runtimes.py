"""Whole sessions through pool + executor on the sandboxed runtimes:

- docker, against podman's Docker API (``eval "$(infra/podman/setup.sh)"``): prepared
  in a container by the pool, run by the executor in the same container, artifacts
  collected, container removed;
- local under bubblewrap with ``network: none``: the harness reaches the proxy only
  through the bridge (at its session URL), another server on the node's loopback stays
  unreachable. The sandbox's own network tests are in test_runtime_bwrap.py.
"""

import asyncio
import sys

import pytest

from schemas import Outcome, SessionState
from services.scheduler import logic
from tests.helpers.node import (
    Node,
    containers,
    leftover_dirs,
    session_procs,
    task,
)
from tests.helpers.requires import DOCKER_HOST, IMAGE, requires_bwrap, requires_docker

pytestmark = pytest.mark.asyncio

PROBE = r"""
import os, socket, sys, urllib.request
base = os.environ["OPENAI_BASE_URL"]
print("PROXY", urllib.request.urlopen(base + "/models", timeout=5).read().decode())
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2).close()
    print("OPEN other")
except OSError as exc:
    print("BLOCKED other", type(exc).__name__)
"""


@requires_docker
async def test_docker_session_end_to_end(fresh_servers, tmp_path):
    work = tmp_path / "work"
    node = await Node.start(*fresh_servers, work, docker_host=DOCKER_HOST)
    try:
        prepare = [
            {"action": "upload_file", "dest": "task.md", "content": "the task\n"},
            {"action": "exec", "command": "mkdir -p repo && echo prepared > repo/p.txt"},
        ]
        spec = task(
            "dk",
            runtime={"backend": "docker", "image": IMAGE, "network": "none", "prepare": prepare},
            agent={
                "command": "cat task.md repo/p.txt > result.txt; echo harness-ok; echo err >&2",
                "output_files": ["result.txt"],
            },
        )
        [s] = await node.scheduler.accept(logic.with_task_id(spec))
        await node.wait_finished(1, timeout=90)
        ev = node.finished[s.session_id]
        assert ev.outcome == Outcome.COMPLETED, ev.reason
        assert ev.artifacts.files == {"result.txt": "the task\nprepared\n"}
        assert ev.artifacts.stdout_tail == "harness-ok\n"
        assert ev.artifacts.stderr_tail == "err\n"
        assert (await node.registry.get_session(s.session_id)).state == SessionState.POSTRUN
        assert await asyncio.to_thread(containers, [f"{s.session_id}-a0-main"]) == []
        assert leftover_dirs(work) == [] and session_procs(s.session_id) == []
    finally:
        await node.stop()


async def _http_server(body: bytes, hits: list[str]) -> tuple[asyncio.AbstractServer, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        hits.append(head.split(b" ")[1].decode())
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@requires_bwrap
async def test_bwrap_network_none_session_reaches_only_the_proxy(fresh_servers, tmp_path):
    proxy_hits: list[str] = []
    other_hits: list[str] = []
    proxy, proxy_port = await _http_server(b"models-from-proxy", proxy_hits)
    other, other_port = await _http_server(b"other", other_hits)
    work = tmp_path / "work"
    node = await Node.start(*fresh_servers, work, proxy_url=f"http://127.0.0.1:{proxy_port}")
    try:
        spec = task(
            "bw",
            runtime={
                "backend": "local",
                "sandbox": "bwrap",
                "network": "none",
                "prepare": [{"action": "upload_file", "dest": "probe.py", "content": PROBE}],
            },
            agent={"command": f"{sys.executable} -I probe.py {other_port}"},
        )
        [s] = await node.scheduler.accept(logic.with_task_id(spec))
        await node.wait_finished(1, timeout=60)
        ev = node.finished[s.session_id]
        assert ev.outcome == Outcome.COMPLETED, (ev.reason, ev.artifacts.stderr_tail)
        lines = ev.artifacts.stdout_tail.splitlines()
        assert lines == ["PROXY models-from-proxy", "BLOCKED other ConnectionRefusedError"]
        assert proxy_hits == [f"/s/{s.token}/v1/models"]  # the session's own base URL
        assert other_hits == []
        assert leftover_dirs(work) == [] and session_procs(s.session_id) == []
    finally:
        await node.stop()
        proxy.close()
        other.close()
