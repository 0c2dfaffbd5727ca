"""A hostile harness in the real sandbox, on a real stack (``polar up``'s credentials on).

Two sessions of one task run a shell harness under bubblewrap (host network, so every
port of the node is in reach). Each one tries what issue 17's attacker did: other
processes' environments (tokens), the other session's directory, the host's private
files and the stack's credentials, Redis and NATS without a password, the proxy's
admin routes and the dashboard's read API. None of it works; its own session route
still does.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import orjson
import pytest

from infra import credentials, devstack
from infra.topology import parse_topology
from schemas import SessionFinished, decode
from schemas import subjects as S
from services.cli.demo import demo_topology
from services.common.bus import Bus
from tests.helpers.requires import requires_bwrap

pytestmark = [requires_bwrap, pytest.mark.asyncio, pytest.mark.timeout(420)]
CHECKOUT = Path(__file__).resolve().parts[2]  # /work/<this>: its bridge is bound back

PROBE = r"""
import glob, hashlib, json, os, re, socket, urllib.error, urllib.request
env = os.environ
base = env["OPENAI_BASE_URL"]  # http://127.0.0.1:<proxy>/s/<token>/v1
root, mine = base.split("/s/")[0], base.split("/s/")[1].split("/")[0]
out = {}
tokens = set()
for path in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline"):
    try:
        tokens |= set(re.findall(rb"ps_[A-Za-z0-9_-]{43}", open(path, "rb").read()))
    except OSError:
        pass
digest = lambda t: hashlib.sha256(t.encode()).hexdigest()  # printed tokens are scrubbed
out["tokens"] = sorted(digest(t.decode()) for t in tokens)
out["own"] = digest(mine)
sessions = os.path.dirname(os.path.dirname(os.getcwd()))  # <sessions>/<runtime>/workdir
out["sessions"] = sorted(os.listdir(sessions))
out["own_runtime"] = os.path.basename(os.path.dirname(os.getcwd()))
for d in ("/root", "/work", "/home"):
    out[d] = sorted(os.listdir(d)) if os.path.isdir(d) else None
try:
    out["shadow"] = open("/etc/shadow").read()
except OSError as exc:
    out["shadow"] = type(exc).__name__
out["credentials"] = os.path.exists(env["STATE_DIR"] + "/credentials.json")
out["checkout"] = os.path.exists(env["PRIVATE_FILE"])

def talk(port, data, first_line=False):
    s = socket.create_connection(("127.0.0.1", int(port)), timeout=5)
    if first_line:
        s.recv(4096)  # NATS says INFO first
    s.sendall(data)
    got = b""
    while b"\r\n" not in got or (first_line and b"ERR" not in got and b"PONG" not in got):
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    s.close()
    return got.decode(errors="replace").strip()

out["redis"] = talk(env["REDIS_PORT"], b"*2\r\n$4\r\nKEYS\r\n$13\r\npolar:token:*\r\n")
out["nats"] = talk(env["NATS_PORT"], b'CONNECT {"verbose":false}\r\nPING\r\n', True)
codes = {}
for path, token in (("/admin/pause", None), ("/admin/pause", mine), ("/admin/flush_cache", None)):
    req = urllib.request.Request(root + path, data=b"{}", method="POST")
    if token:
        req.add_header("authorization", "Bearer " + token)
    try:
        codes[path + (" own-token" if token else "")] = urllib.request.urlopen(req, timeout=5).status
    except urllib.error.HTTPError as exc:
        codes[path + (" own-token" if token else "")] = exc.code
out["admin"] = codes
dash = {}  # the dashboard's read API: every session's calls, output and diffs
for token in (None, mine):
    req = urllib.request.Request(f"http://127.0.0.1:{env['DASH_PORT']}/api/sessions")
    if token:
        req.add_header("authorization", "Bearer " + token)
    try:
        dash["own-token" if token else "none"] = urllib.request.urlopen(req, timeout=5).status
    except urllib.error.HTTPError as exc:
        dash["own-token" if token else "none"] = exc.code
out["dashboard"] = dash
req = urllib.request.Request(base + "/models")
out["own_route"] = urllib.request.urlopen(req, timeout=5).status
print("PROBE " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def stack():
    state_dir = Path(tempfile.mkdtemp(prefix="polar-hostile-", dir="/var/tmp"))
    topo = parse_topology(demo_topology(state_dir), "hostile topology")
    devstack.up(topo)
    yield topo, state_dir
    report = devstack.down(state_dir)
    assert not report.still_listening


def hostile_task(topo, state_dir: Path) -> dict:
    def port(url: str) -> str:
        return url.rsplit(":", 1)[1].split("/")[0]

    return {
        "task_id": "hostile",
        "instruction": "take over the node",
        "num_samples": 2,
        "timeout_seconds": 300,
        "agent_timeout_seconds": 120,
        "runtime": {
            "backend": "local",
            "sandbox": "bwrap",
            "network": "host",
            "prepare": [{"action": "upload_file", "dest": "probe.py", "content": PROBE}],
        },
        "agent": {
            "harness": "shell",
            "command": f"{sys.executable} -I probe.py",
            "env": {
                "REDIS_PORT": port(topo.redis_url),
                "NATS_PORT": port(topo.nats_url),
                "DASH_PORT": str(topo.services["dashboard"].port),
                "STATE_DIR": str(state_dir),
                "PRIVATE_FILE": str(Path(__file__).resolve()),  # this checkout
            },
        },
    }


async def test_a_hostile_harness_reaches_nothing_but_its_own_session(stack):
    topo, state_dir = stack
    creds = credentials.load(state_dir)
    bus = await Bus.open(creds.nats_url(topo.nats_url), "hostile-test", declare=False)
    finished: list[SessionFinished] = []

    async def on_finished(msg) -> None:
        finished.append(decode(await bus.payload(msg), SessionFinished))

    sub = await bus.nc.subscribe(S.SESSIONS_FINISHED, cb=on_finished)
    try:
        await bus.js.publish(S.TASKS_SUBMIT, orjson.dumps(hostile_task(topo, state_dir)))
        for _ in range(1200):
            if len(finished) == 2:
                break
            await asyncio.sleep(0.1)
    finally:
        await sub.unsubscribe()
        await bus.close()
    assert len(finished) == 2, finished
    probes = []
    for ev in finished:
        line = next(x for x in ev.artifacts.stdout_tail.splitlines() if x.startswith("PROBE "))
        probes.append(json.loads(line.removeprefix("PROBE ")))
    for p in probes:
        assert set(p["tokens"]) <= {p["own"]}  # no other session's token anywhere in /proc
        assert p["sessions"] == [p["own_runtime"]]  # not the other session's directory
        # empty, but for the interpreter and this package's bridge bound back read-only
        python = {Path(sys.base_prefix).parts[2], Path(sys.prefix).parts[2]}
        assert set(p["/root"]) <= python and p["/home"] in ([], None), p["/root"]
        assert p["/work"] in ([], None) or set(p["/work"]) <= python | {CHECKOUT}, p["/work"]
        assert p["shadow"] in ("", "PermissionError")  # /dev/null, on a nodev mount
        assert p["credentials"] is False and p["checkout"] is False
        assert p["redis"].startswith("-NOAUTH"), p["redis"]
        assert "Authorization Violation" in p["nats"], p["nats"]
        assert set(p["admin"].values()) == {401}, p["admin"]
        assert p["dashboard"] == {"none": 401, "own-token": 401}, p["dashboard"]
        assert p["own_route"] == 200
