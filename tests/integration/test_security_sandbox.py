"""A hostile harness in the real sandbox, on a real stack (``polar up``'s credentials on).

Two sessions run a shell harness under bubblewrap, and each tries what issue 17's
attacker did: other processes' environments (tokens), the other session's directory,
the host's private files and the stack's credentials, Redis and NATS without a
password, the proxy's admin routes, the embedded engine's admin and completion routes
(uncaptured sampling, pause, weight swaps) and the dashboard's read API. One has the
local runtime's defaults: its network is isolated (issue 33), so nothing of the node is
in reach but the proxy bridge. The other asked for ``network: host``: every port is in
reach, and each refuses it without its credential. Both still reach their own route.

A third session runs with ``network: none`` (the proxy bridge) and holds another live
session's token, as if it had leaked: through the bridge it reaches its own routes and
nothing of the other session's.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import orjson
import pytest
import redis.asyncio as aioredis

from infra import credentials, devstack
from infra.topology import parse_topology
from schemas import SessionFinished, decode
from schemas import subjects as S
from schemas.session import SessionState
from services.cli.demo import demo_topology
from services.common.bus import Bus
from services.common.registry import Registry
from tests.helpers.requires import requires_bwrap

pytestmark = [requires_bwrap, pytest.mark.asyncio, pytest.mark.timeout(420)]
CHECKOUT = Path(__file__).resolve().parts[2]  # /work/<it>: its bridge script is bound back

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

out["net"] = env["NET"]

def talk(port, data, first_line=False):
    try:
        s = socket.create_connection(("127.0.0.1", int(port)), timeout=5)
    except OSError:
        return "unreachable"
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
    except OSError:
        codes[path + (" own-token" if token else "")] = "unreachable"
out["admin"] = codes
engine = "http://127.0.0.1:" + env["MODEL_PORT"]
chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
codes = {}
for path, body in (
    ("/pause_generation", {"mode": "abort"}),
    ("/continue_generation", {}),
    ("/update_weights_from_disk", {"model_path": "/tmp"}),
    ("/abort_request", {"abort_all": True}),
    ("/flush_cache", {}),
    ("/v1/chat/completions", chat),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
):
    req = urllib.request.Request(engine + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("content-type", "application/json")
    req.add_header("authorization", "Bearer " + mine)  # its own token is no engine key
    try:
        codes[path] = urllib.request.urlopen(req, timeout=20).status
    except urllib.error.HTTPError as exc:
        codes[path] = exc.code
    except OSError:
        codes[path] = "unreachable"
out["engine"] = codes
dash = {}  # the dashboard's read API: every session's calls, output and diffs
for token in (None, mine):
    req = urllib.request.Request(f"http://127.0.0.1:{env['DASH_PORT']}/api/sessions")
    if token:
        req.add_header("authorization", "Bearer " + token)
    try:
        dash["own-token" if token else "none"] = urllib.request.urlopen(req, timeout=5).status
    except urllib.error.HTTPError as exc:
        dash["own-token" if token else "none"] = exc.code
    except OSError:
        dash["own-token" if token else "none"] = "unreachable"
out["dashboard"] = dash
req = urllib.request.Request(base + "/models")
out["own_route"] = urllib.request.urlopen(req, timeout=5).status
print("PROBE " + json.dumps(out))
"""

# Inside a `network: none` sandbox: only the bridge on 127.0.0.1:<proxy port>.
BRIDGE_PROBE = r"""
import json, os, secrets, urllib.error, urllib.request
base = os.environ["OPENAI_BASE_URL"]  # http://127.0.0.1:<proxy>/s/<token>/v1
root = base.split("/s/")[0]
def status(url):
    try:
        return urllib.request.urlopen(urllib.request.Request(url), timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code
out = {
    "own": status(base + "/models"),
    "other": status(root + "/s/" + os.environ["OTHER_TOKEN"] + "/v1/models"),
    "forged": status(root + "/s/ps_" + secrets.token_urlsafe(32) + "/v1/models"),
}
print("BRIDGE " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def stack():
    state_dir = Path(tempfile.mkdtemp(prefix="polar-hostile-", dir="/var/tmp"))
    topo = parse_topology(demo_topology(state_dir), "hostile topology")
    devstack.up(topo)
    yield topo, state_dir
    report = devstack.down(state_dir)
    assert not report.still_listening


def hostile_task(topo, state_dir: Path, network: str | None = None) -> dict:
    """With ``network`` None, the local runtime's defaults (sandbox: auto -> bubblewrap,
    network: auto -> isolated, the proxy bridge): what a task gets that names neither."""

    def port(url: str) -> str:
        return url.rsplit(":", 1)[1].split("/")[0]

    return {
        "task_id": f"hostile-{network or 'default'}",
        "instruction": "take over the node",
        "num_samples": 1,
        "timeout_seconds": 300,
        "agent_timeout_seconds": 120,
        "runtime": {
            "backend": "local",
            **({"network": network} if network else {}),
            "prepare": [{"action": "upload_file", "dest": "probe.py", "content": PROBE}],
        },
        "agent": {
            "harness": "shell",
            "command": f"{sys.executable} -I probe.py",
            "env": {
                "NET": network or "default",
                "REDIS_PORT": port(topo.redis_url),
                "NATS_PORT": port(topo.nats_url),
                "MODEL_PORT": str(topo.services["model"].port),
                "DASH_PORT": str(topo.services["dashboard"].port),
                "STATE_DIR": str(state_dir),
                "PRIVATE_FILE": str(Path(__file__).resolve()),  # this checkout
            },
        },
    }


def shell_task(task_id: str, runtime: dict, command: str, env: dict, probe: str = "") -> dict:
    prepare = [{"action": "upload_file", "dest": "probe.py", "content": probe}] if probe else []
    return {
        "task_id": task_id,
        "instruction": "take over the node",
        "num_samples": 1,
        "timeout_seconds": 300,
        "agent_timeout_seconds": 120,
        "runtime": {"backend": "local", "sandbox": "bwrap", **runtime, "prepare": prepare},
        "agent": {"harness": "shell", "command": command, "env": env},
    }


async def live_token(registry: Registry, task_id: str) -> str:
    """The token of ``task_id``'s session once it is RUNNING (valid at the proxy)."""
    for _ in range(1200):
        sessions = await registry.task_sessions(task_id)
        if sessions and sessions[0].state == SessionState.RUNNING:
            return sessions[0].token
        await asyncio.sleep(0.1)
    raise AssertionError(f"{task_id} never ran: {sessions}")


async def test_a_hostile_harness_reaches_nothing_but_its_own_session(stack):
    topo, state_dir = stack
    creds = credentials.load(state_dir)
    bus = await Bus.open(creds.nats_url(topo.nats_url), "hostile-test", declare=False)
    redis = aioredis.from_url(creds.redis_url(topo.redis_url))
    finished: list[SessionFinished] = []

    async def on_finished(msg) -> None:
        finished.append(decode(await bus.payload(msg), SessionFinished))

    sub = await bus.nc.subscribe(S.SESSIONS_FINISHED, cb=on_finished)
    try:
        # a session that stays RUNNING: its token is live while the others probe
        victim = shell_task("victim", {"network": "host"}, "sleep 100", {})
        await bus.js.publish(S.TASKS_SUBMIT, orjson.dumps(victim))
        other = await live_token(Registry(redis), "victim")
        bridged = shell_task(
            "hostile-bridge",
            {"network": "none"},
            f"{sys.executable} -I probe.py",
            {"OTHER_TOKEN": other},
            BRIDGE_PROBE,
        )
        for network in (None, "host"):
            task = hostile_task(topo, state_dir, network)
            await bus.js.publish(S.TASKS_SUBMIT, orjson.dumps(task))
        await bus.js.publish(S.TASKS_SUBMIT, orjson.dumps(bridged))
        probing = {"hostile-default", "hostile-host", "hostile-bridge"}
        for _ in range(1200):
            if len([ev for ev in finished if ev.task_id in probing]) == 3:
                break
            await asyncio.sleep(0.1)
    finally:
        await sub.unsubscribe()
        await bus.close()
        await redis.aclose()
    ours = [ev for ev in finished if ev.task_id in probing]
    assert len(ours) == 3, finished
    probes, bridge = [], []
    for ev in ours:
        for line in ev.artifacts.stdout_tail.splitlines():
            if line.startswith("PROBE "):
                probes.append(json.loads(line.removeprefix("PROBE ")))
            elif line.startswith("BRIDGE "):
                bridge.append(json.loads(line.removeprefix("BRIDGE ")))
    assert len(probes) == 2 and len(bridge) == 1, [ev.artifacts.stdout_tail for ev in ours]
    for p in probes:
        assert set(p["tokens"]) <= {p["own"]}  # no other session's token anywhere in /proc
        assert p["sessions"] == [p["own_runtime"]]  # not the other session's directory
        # empty, but for the interpreter and this package's bridge bound back read-only
        # (nothing for a system Python under /usr)
        prefixes = (Path(sys.base_prefix), Path(sys.prefix))
        python = {p.parts[2] for p in prefixes if len(p.parts) > 2}
        # and the CLI cache, bound back read-only (~/.cache/polar/harness-cache: `polar up`
        # shares the user's, issue 38.9); the rest of ~/.cache stays hidden
        cache = Path.home() / ".cache"
        exposed = python | ({cache.name} if cache.parent == Path("/root") else set())
        assert set(p["/root"]) <= exposed and p["/home"] in ([], None), p["/root"]
        assert p["/work"] in ([], None) or set(p["/work"]) <= python | {CHECKOUT}, p["/work"]
        assert p["shadow"] in ("", "PermissionError")  # /dev/null, on a nodev mount
        assert p["credentials"] is False and p["checkout"] is False
        assert p["own_route"] == 200
    default, host = sorted(probes, key=lambda p: p["net"])
    # isolated by default (issue 33): nothing of the node in reach but the bridge, whose
    # root and /admin/* are a 403
    assert default["net"] == "default"
    assert (default["redis"], default["nats"]) == ("unreachable", "unreachable"), default
    assert set(default["engine"].values()) == {"unreachable"}, default["engine"]
    assert set(default["dashboard"].values()) == {"unreachable"}, default["dashboard"]
    assert set(default["admin"].values()) == {403}, default["admin"]
    # `network: host`, asked for: every port in reach, each refusing without its credential
    assert host["redis"].startswith("-NOAUTH"), host["redis"]
    assert "Authorization Violation" in host["nats"], host["nats"]
    assert set(host["admin"].values()) == {401}, host["admin"]
    assert set(host["engine"].values()) == {401}, host["engine"]  # the engine key, issue 17
    assert host["dashboard"] == {"none": 401, "own-token": 401}, host["dashboard"]
    # the bridge passes its own session's routes only, even with a live token of another
    assert bridge[0] == {"own": 200, "other": 403, "forged": 403}, bridge[0]
