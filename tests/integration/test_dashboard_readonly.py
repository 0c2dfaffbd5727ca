"""The dashboard only reads (issue 19), shown by the servers themselves on a stack
`polar up` started, with one demo session run through it.

- Redis: Valkey's ``MONITOR`` sees every command from the stack starting its task to the
  end of the browsing; ``CLIENT LIST`` says which connections are the dashboard's (it
  names them, ``polar-dashboard``, and they are all of its process's connections to
  Valkey). None of its commands may carry the server's ``write`` flag (``COMMAND INFO``,
  not a list kept here), and any script it runs must be a read-only one (EVAL_RO,
  EVALSHA_RO, FCALL_RO: the server refuses a write inside them).
- NATS: browsing every page and API route of an idle stack publishes no message to any
  stream (the object store's included) and leaves no new durable consumer (JetStream's
  stream and consumer info, before and after).
- The overview's engine row and backpressure flag, as the API names them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import orjson
import psutil
import pytest
import redis

from infra import credentials
from infra.stackstate import read_state
from schemas import subjects as S
from services.cli.demo import demo_task
from services.common.bus import Bus
from services.dashboard.reader import REDIS_CLIENT_NAME
from tests.helpers.polar_cli import demo_stack_up

pytestmark = [pytest.mark.timeout(300)]
TASK, SESSION = "dash-ro", "dash-ro-0000"
END = "dashboard-readonly-monitor-end"  # the ECHO that ends the MONITOR reader


class Monitor:
    """Valkey's MONITOR on a connection of its own, read in a thread until ``stop``."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.lines: list[dict] = []
        self._mon = self.client.monitor().__enter__()  # MONITOR answered: it sees what follows
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            line = self._mon.next_command()
            if END in line["command"]:
                return
            self.lines.append(line)

    def stop(self) -> list[dict]:
        self.client.echo(END)
        self._thread.join(30)
        assert not self._thread.is_alive(), "MONITOR never saw the end marker"
        self._mon.__exit__()
        self.client.close()
        return self.lines


def command_info(client: redis.Redis, name: str) -> tuple[set[bytes], set[bytes], bool]:
    """(flags, ACL categories, has subcommands) of one command, as the server says (the
    raw reply: redis-py's own parsing of COMMAND drops the categories)."""
    conn = client.connection_pool.get_connection()
    try:
        conn.send_command("COMMAND", "INFO", name)
        (info,) = conn.read_response()
    finally:
        client.connection_pool.release(conn)
    assert info is not None, f"the server knows no command {name!r}"
    return set(info[2]), set(info[6]), bool(info[9])


def offences(client: redis.Redis, commands: list[str]) -> list[str]:
    """Commands (as MONITOR shows them) that write, or run a script that may."""
    bad = []
    for words in sorted({tuple(c.lower().split(" ")[:2]) for c in commands}):
        name = words[0]
        flags, cats, container = command_info(client, name)
        if container:  # CLIENT SETNAME: the subcommand's own flags
            name = "|".join(words)
            flags, cats, _ = command_info(client, name)
        if b"write" in flags:
            bad.append(f"{name}: flagged write")
        if b"@scripting" in cats and b"readonly" not in flags:
            bad.append(f"{name}: a script that may write (not *_RO)")
    return bad


def dashboard_addresses(client: redis.Redis, dashboard_pid: int, redis_port: int) -> set[str]:
    """The dashboard's connections by CLIENT LIST's name, checked to be all that its
    process (and its workers) hold to Valkey: none escapes the check unnamed."""
    named = {c["addr"] for c in client.client_list() if c.get("name") == REDIS_CLIENT_NAME}
    proc = psutil.Process(dashboard_pid)
    held = {
        f"{c.laddr.ip}:{c.laddr.port}"
        for p in (proc, *proc.children(recursive=True))
        for c in p.net_connections(kind="tcp")
        if c.raddr and c.raddr.port == redis_port and c.status == psutil.CONN_ESTABLISHED
    }
    assert named, "no Valkey connection is named " + REDIS_CLIENT_NAME
    assert held == named, (held, named)
    return named


async def jetstream_state(nats_url: str) -> dict[str, tuple[int, frozenset[str]]]:
    """Each stream's last sequence and its durable consumers."""
    bus = await Bus.open(nats_url, "dash-readonly-check", declare=False)
    try:
        out = {}
        for info in await bus.js.streams_info():
            name = info.config.name
            durable = frozenset(
                c.name for c in await bus.js.consumers_info(name) if c.config.durable_name
            )
            out[name] = (info.state.last_seq, durable)
        return out
    finally:
        await bus.close()


async def until_idle(nats_url: str) -> dict[str, tuple[int, frozenset[str]]]:
    """JetStream's state once nothing changed it for two seconds (the session's builder,
    evaluator and their acks have all had their say)."""
    last = await jetstream_state(nats_url)
    for _ in range(60):
        await asyncio.sleep(2.0)
        now = await jetstream_state(nats_url)
        if now == last:
            return now
        last = now
    raise AssertionError(f"the stack never went idle: {last}")


@pytest.fixture(scope="module")
def stack():
    with demo_stack_up("polar-dash-ro-") as (topo, _, _up):
        creds = credentials.load(Path(topo.state_dir))
        assert creds is not None and creds.redis_password
        yield topo, creds


def test_the_dashboard_writes_nothing_to_redis_or_nats(stack):
    topo, creds = stack
    url = f"http://127.0.0.1:{topo.services['dashboard'].port}"
    read = {"authorization": f"Bearer {creds.read_token}"}
    redis_url, nats_url = creds.redis_url(topo.redis_url), creds.nats_url(topo.nats_url)
    record = read_state(Path(topo.state_dir))
    dash = next(p for p in record.procs if p.name.startswith("dashboard"))
    redis_port = next(p for p in record.procs if p.name == "redis").port

    def get(path: str) -> bytes:
        r = httpx.get(url + path, headers=read, timeout=30)
        assert r.status_code == 200, (path, r.text)
        return r.content

    def api(path: str) -> dict:
        return orjson.loads(get(path))

    # from the task's start: the dashboard reads a new task's records as its events come
    monitor = Monitor(redis_url)
    try:
        asyncio.run(submit(nats_url, demo_task(TASK) | {"num_samples": 1}))
        for _ in range(240):  # ended, its reward read, its trajectory built
            body = (
                api(f"/api/sessions/{SESSION}") if SESSION.encode() in get("/api/sessions") else {}
            )
            if body.get("settled") and not api(f"/api/sessions/{SESSION}/trajectory")["note"]:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"{SESSION} never settled with a trajectory: {body}")
        before = asyncio.run(until_idle(nats_url))

        for path in (
            "/",
            f"/tasks/{TASK}",
            f"/sessions/{SESSION}",
            f"/sessions/{SESSION}/trajectory",
            "/training",
            "/topology",
            "/api/overview",
            "/api/sessions",
            f"/api/sessions?task={TASK}",
            f"/api/tasks/{TASK}",
            f"/api/sessions/{SESSION}",
            *(f"/api/sessions/{SESSION}/trajectory?view={v}" for v in api_views(url, read)),
            "/api/training",
            "/api/topology",
        ):
            get(path)
        with httpx.stream("GET", url + "/api/live", headers=read, timeout=10) as live:
            lines = live.iter_lines()
            assert next(lines).startswith("event: change") and next(lines).startswith("data:")
        time.sleep(1.5)  # a few of the dashboard's own polls, too

        client = redis.Redis.from_url(redis_url)
        addrs = dashboard_addresses(client, dash.pid, redis_port)
    finally:
        lines = monitor.stop()
    after = asyncio.run(jetstream_state(nats_url))

    ours = [ln["command"] for ln in lines if f"{ln['client_address']}:{ln['client_port']}" in addrs]
    names = {c.split(" ")[0].lower() for c in ours}
    # it was watched doing its reads: the task's records, the session, the stack poll
    assert {"hmget", "hgetall", "exists", "lrange"} <= names, names
    bad = offences(client, ours)
    assert not bad, bad
    client.close()

    # NATS: nothing published to any stream, no durable consumer left behind
    changed = {k: (before.get(k), after.get(k)) for k in {*before, *after}}
    assert after == before, {k: v for k, v in changed.items() if v[0] != v[1]}
    assert f"OBJ_{S.OBJECT_STORE}" in after  # the object store is among the streams checked


def api_views(url: str, read: dict) -> list[str]:
    r = httpx.get(f"{url}/api/sessions/{SESSION}/trajectory", headers=read, timeout=30)
    views = r.json()["views"]
    assert {"stored", "per_request", "prefix_merging"} <= set(views), views
    return views


async def submit(nats_url: str, task: dict) -> None:
    bus = await Bus.open(nats_url, "dash-readonly", declare=False)
    try:
        await bus.js.publish(S.TASKS_SUBMIT, orjson.dumps(task))
    finally:
        await bus.close()


def test_the_overview_shows_the_engines_and_backpressure(stack):
    topo, creds = stack
    url = f"http://127.0.0.1:{topo.services['dashboard'].port}"
    read = {"authorization": f"Bearer {creds.read_token}"}
    (backend,) = topo.backends

    def overview() -> dict:
        r = httpx.get(url + "/api/overview", headers=read, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def until(check) -> dict:
        for _ in range(120):  # 30 s: the dashboard's polls of the engine may lag under load
            body = overview()
            if check(body):
                return body
            time.sleep(0.25)
        raise AssertionError(body)

    # the embedded engine answers its /metrics with the queue gauge: nothing waiting (once
    # the dashboard has seen it up: a look before the engine was listening says down)
    body = until(lambda b: b["engines"] and b["engines"][0]["up"])
    assert body["engines"] == [
        {"name": backend.name, "kind": "embedded", "url": backend.url, "queue": 0.0, "up": True}
    ]
    assert body["backpressure"] is False
    # an operator holding INIT by hand (the key the pools check): the overview says so
    client = redis.Redis.from_url(creds.redis_url(topo.redis_url))
    try:
        client.set(S.KEY_BACKPRESSURE, "held by the test", px=30_000)
        until(lambda b: b["backpressure"] is True)
        client.delete(S.KEY_BACKPRESSURE)
        until(lambda b: b["backpressure"] is False)
    finally:
        client.delete(S.KEY_BACKPRESSURE)
        client.close()
