"""A chaos test's stack: real processes on servers of its own (free ports, its own
directories, so it may kill them), started as ``polar up`` starts them: nats-server with
a user per service (``infra/credentials.py``), Valkey with a password and the dev
stack's durability. The tasks it runs: a short prepare step, then ``agent.py``'s chat
calls through the session's proxy route, each retried while the stack is faulty."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
from nats.js.errors import NotFoundError

from infra import credentials, localservers
from schemas import SessionState, Trajectory, decode
from schemas import subjects as S
from services.common.bus import Bus
from tests.helpers.procs import ServiceProcess
from tests.helpers.stack import POLICIES, EmbeddedServer
from tests.unit.engine.tiny import tiny_model_dir

ST = SessionState
# Leases shorter than the default (30 s), for quick recovery from a holder's death, but
# longer than the Valkey outage plus a renewal period or two: a holder that cannot renew
# while the registry is down is alive, and a lease that ran out meanwhile makes a reaper
# stop its running harness (with 2 s, 1 session in 54 ended ERROR that way: the harness
# SIGTERMed, exit 143, its executor's finish landing before the reaper's retry).
LEASE = 15.0
SESSIONS = 2  # per task
CALLS = 3  # model calls per session
VALKEY_OUTAGE_S = 5.0  # the 5-second registry outage
# Every fault here is the system's, and the system retries it: a lost holder (a new
# attempt, ``infra_retries``), a bus or registry fault during INIT (run again in place),
# a lease lapsed while Valkey was down (not reaped: its holder renews once it is back),
# model calls (the agent's own retries through the proxy). A session submitted early
# lives through every later round, so its holder (pool or executor) may be killed twice
# a round: its task allows that many new attempts (a task's default is 2).
INFRA_RETRIES = 10
AGENT = Path(__file__).with_name("agent.py")
TARGETS = {
    "scheduler": "services.scheduler.main:create_app",
    "pool": "services.pool.main:create_app",
    "executor": "services.executor.main:create_app",
    "builder": "services.builder.main:create_app",
    "evaluator": "services.evaluator.main:create_app",
    "proxy": "proxy.main:create_app",
}


class Stack:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.nats_port, self.redis_port = localservers.free_port(), localservers.free_port()
        self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        # as `polar up` makes them: a NATS user per service, the operator's, a password
        self.creds = credentials.generate(
            [*TARGETS, credentials.OPERATOR], own_nats=True, own_redis=True
        )
        self.procs: dict[str, ServiceProcess] = {}
        self.submitted: dict[str, float] = {}

    def start_servers(self) -> None:
        self._start_nats()
        self._start_valkey()
        self.engine = self._engine(0)

    def _start_nats(self) -> None:
        users = dict(self.creds.nats_passwords)
        self.nats = localservers.start_nats(self.nats_port, self.root / "nats", users=users)

    def _start_valkey(self) -> None:
        password = self.creds.redis_password
        self.valkey = localservers.start_valkey(
            self.redis_port, self.root / "valkey", password=password
        )

    def _engine(self, port: int) -> EmbeddedServer:
        policy = POLICIES / "shell_agent.yaml"
        return EmbeddedServer(
            tiny_model_dir(), policy=policy, log_dir=self.root / "logs", port=port
        ).wait()

    @property
    def client_nats_url(self) -> str:
        return self.creds.nats_url(self.nats_url)

    @property
    def client_redis_url(self) -> str:
        return self.creds.redis_url(self.redis_url)

    def config(self, name: str) -> dict:
        base = {"nats_url": self.creds.nats_url(self.nats_url, name),
                "redis_url": self.client_redis_url}  # fmt: skip
        work = {"work_dir": str(self.root / "work"), "node": "chaos0"}
        node = {**work, "lease_seconds": LEASE, "heartbeat_seconds": 0.5, "max_init": 8,
                "ready_buffer": 4, "max_run": 8}  # fmt: skip
        if "proxy" in self.procs:
            node["proxy_url"] = self.procs["proxy"].url
        return {
            "scheduler": {
                **base,
                "reconcile_interval_seconds": 1.0,
                "admin_token": self.creds.admin_token,
            },
            "pool": {**base, **node},
            "executor": {**base, **node},
            "builder": {**base, "ack_wait_seconds": 3.0, "retry_delay_seconds": 0.2},
            "evaluator": {**base, **work, "ack_wait_seconds": 3.0, "retry_delay_seconds": 0.2},
            "proxy": {
                **base,
                "mode": "token",
                "model_dir": str(tiny_model_dir()),
                "backend": {"kind": "embedded", "urls": [self.engine.url]},
            },  # fmt: skip
        }[name]

    def start(self, name: str, restarts: int = 0) -> None:
        cfg = self.config(name)
        if name in self.procs:
            cfg["port"] = self.procs[name].port
        proc = ServiceProcess(TARGETS[name], cfg, self.root / "logs")
        self.procs[name] = proc.start(60, restarts=restarts)

    async def supervise(self, name: str, restarts: list[float]) -> None:
        """Start ``name`` again whenever its process ends, as systemd or Kubernetes would
        (each restart's time in ``restarts``); until cancelled."""
        while True:
            proc = self.procs[name].proc
            if proc is not None and proc.poll() is not None:
                restarts.append(time.monotonic())
                with contextlib.suppress(Exception):  # died again on its way up: next look
                    await asyncio.to_thread(self.start, name, 8)
            await asyncio.sleep(0.2)

    async def kill_and_restart(self, fault: str, down_s: float | None = None) -> None:
        """kill -9 ``fault``'s process and start it again after ``down_s`` (default: at
        once, Valkey after ``VALKEY_OUTAGE_S``), on its same port and directory."""
        if down_s is None:
            down_s = VALKEY_OUTAGE_S if fault == "valkey" else 0.0
        if fault == "nats-server":
            self.nats.kill()
            self.nats.wait(10)
            await asyncio.sleep(down_s)
            await asyncio.to_thread(self._start_nats)
        elif fault == "valkey":
            self.valkey.kill()
            self.valkey.wait(10)
            await asyncio.sleep(down_s)
            await asyncio.to_thread(self._start_valkey)
        elif fault == "model":
            os.killpg(self.engine.proc.pid, 9)
            self.engine.proc.wait(10)
            await asyncio.sleep(down_s)
            self.engine = await asyncio.to_thread(self._engine, self.engine.port)
        else:
            self.procs[fault].kill()
            await asyncio.sleep(down_s)
            # restarted while this round's Valkey or NATS fault has its server down, a
            # service exits at start-up (it says why): started again, as a supervisor would,
            # for as long as another fault of the round may keep its server down
            await asyncio.to_thread(self.start, fault, 8 + 2 * int(down_s))

    def log_tail(self, name: str, lines: int = 40) -> str:
        """The end of a service's log (what a failing assertion shows)."""
        logs = sorted((self.root / "logs").glob(f"*{name}*"))
        return "\n".join(
            f"== {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            for path in logs
        )

    def stop(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(Exception):
                p.kill()
        with contextlib.suppress(Exception):
            self.engine.stop()
        for server in (self.nats, self.valkey):
            localservers.stop_process(server.pid)


def task(task_id: str, retry_calls_s: float | None = None, **fields) -> bytes:
    """A task of ``SESSIONS`` sessions of ``agent.py``; ``retry_calls_s``: how long the
    agent retries each call (longer than the longest outage); ``fields``: the task's
    other fields (a plugin, say)."""
    prepare = [
        {"action": "exec", "command": "sleep 0.3"},
        # shipped in: the shell harness runs in bubblewrap, which hides this checkout
        {"action": "upload_file", "src": str(AGENT), "dest": "agent.py"},
    ]
    return orjson.dumps(
        {
            "task_id": task_id,
            "instruction": "chaos",
            "num_samples": SESSIONS,
            "timeout_seconds": 600,  # longer than the whole run: sessions wait out every round
            "infra_retries": INFRA_RETRIES,
            "runtime": {"backend": "local", "prepare": prepare},
            "agent": {
                "command": f"{sys.executable} agent.py {CALLS}",
                **({"env": {"CHAOS_RETRY_S": str(retry_calls_s)}} if retry_calls_s else {}),
            },
            **fields,
        }
    )


async def states(redis, task_id: str) -> list[str]:
    ids = [i.decode() for i in await redis.lrange(S.key_task_sessions(task_id), 0, -1)]
    return [(await redis.hget(S.key_session(i), "state") or b"?").decode() for i in ids]


async def wait_for_state(redis, task_id: str, state: ST | None, timeout: float = 45.0) -> str:
    """Until one of the task's sessions is in ``state``: what the task looked like."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):  # the registry may be restarting
            now = await states(redis, task_id)
            if state is None or state.value in now:
                return "/".join(sorted(set(now))) or "unregistered"
        if time.monotonic() > deadline:
            return "missed:" + "/".join(sorted(set(now)))
        await asyncio.sleep(0.02)


async def publish(bus: Bus, task_id: str, payload: bytes | None = None) -> None:
    """Submit ``task(task_id)`` (or ``payload``), again while the server is away."""
    for _ in range(40):  # the server may be on its way back
        try:
            await bus.publish(S.TASKS_SUBMIT, payload or task(task_id), msg_id=task_id)
            return
        except Exception:  # noqa: BLE001
            await asyncio.sleep(0.25)
    raise AssertionError(f"could not submit {task_id}")


async def delivered(bus: Bus) -> tuple[Counter, Counter]:
    """session id -> trajectories in polar.trajectories.> (read, not consumed), and ->
    the model calls its trajectory holds."""
    out: Counter = Counter()
    calls: Counter = Counter()
    info = await bus.js.stream_info(S.STREAM_TRAJECTORIES)
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        with contextlib.suppress(NotFoundError):
            msg = await bus.js.get_msg(S.STREAM_TRAJECTORIES, seq)
            data = await bus.payload(msg)
            t = decode(data, Trajectory)
            out[t.session_id] += 1
            calls[t.session_id] = t.stats.completions
    return out, calls
