"""Real processes for end-to-end tests: the embedded model server and the proxy."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from infra import localservers
from schemas import SessionState, TaskRequest
from services.common.bus import Bus
from services.common.registry import Registry
from tests.helpers.procs import ServiceProcess
from tests.unit.engine.tiny import tiny_model_dir

POLICIES = Path(__file__).resolve().parents[1] / "fixtures" / "policies"


class EmbeddedServer:
    def __init__(
        self, model_dir: Path, *, policy: Path | None = None, log_dir: Path, port: int = 0
    ) -> None:
        self.port = port or localservers.free_port()  # a port: restarted where it was
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable,
            "-m",
            "services.engine",
            "--model-dir",
            str(model_dir),
            "--port",
            str(self.port),
        ]
        if policy:
            argv += ["--policy", str(policy)]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / f"embedded-{self.port}.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait(self, timeout: float = 120.0) -> EmbeddedServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"embedded server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("embedded server not healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            localservers.stop_process(self.proc.pid)


def start_proxy(nats_url, redis_url, backend_url, model_dir, log_dir, *, mode="token", **extra):
    cfg = {
        "nats_url": nats_url,
        "redis_url": redis_url,
        "mode": mode,
        "model_dir": str(model_dir),
        "keepalive_seconds": 2.0,
        "backend": {"kind": "embedded", "urls": [backend_url]},
        **extra,
    }
    return ServiceProcess("proxy.main:create_app", cfg, log_dir).start(timeout=60)


@contextmanager
def embedded_engine(policy: str, log_dir: Path) -> Iterator[EmbeddedServer]:
    """The tiny model served with one of ``tests/fixtures/policies``, for a module."""
    srv = EmbeddedServer(tiny_model_dir(), policy=POLICIES / policy, log_dir=log_dir).wait()
    try:
        yield srv
    finally:
        srv.stop()


@contextmanager
def proxy_process(nats_url, redis_url, engine, log_dir, **extra) -> Iterator[ServiceProcess]:
    """The proxy in front of ``engine``, with the tiny model's tokenizer."""
    proxy = start_proxy(nats_url, redis_url, engine.url, tiny_model_dir(), log_dir, **extra)
    try:
        yield proxy
    finally:
        proxy.stop()


def declare_streams(nats_url: str) -> None:
    """The stack's streams, as any of its services declares them when it starts."""

    async def declare() -> None:
        await (await Bus.open(nats_url, "test-declare-streams")).close()

    asyncio.run(declare())


@dataclass
class LoneDashboard:
    """A dashboard over NATS and Valkey of its own, with no other service of a stack."""

    nats: subprocess.Popen
    valkey: subprocess.Popen
    dash: ServiceProcess
    config: dict


@contextmanager
def lone_dashboard(
    tmp_path: Path, read_token: str, *, streams: bool, **config
) -> Iterator[LoneDashboard]:
    """NATS, Valkey (stopped by the test at will) and a dashboard polling them often;
    ``streams``: declared first, as a running stack has them; ``config``: the dashboard's
    besides (a stack record's dir, a trainer log, an admin token)."""
    nport, rport = localservers.free_port(), localservers.free_port()
    nats = localservers.start_nats(nport, tmp_path / "nats")
    valkey = localservers.start_valkey(rport, tmp_path / "valkey")
    cfg = {
        "nats_url": f"nats://127.0.0.1:{nport}",
        "redis_url": f"redis://127.0.0.1:{rport}/0",
        "refresh_seconds": 0.2,
        "stack_poll_seconds": 0.5,
        "read_token": read_token,
        **config,
    }
    dash = None
    try:
        if streams:
            declare_streams(cfg["nats_url"])
        dash = ServiceProcess("services.dashboard.main:create_app", cfg, tmp_path).start(timeout=60)
        yield LoneDashboard(nats, valkey, dash, cfg)
    finally:
        if dash is not None:
            dash.stop()
        localservers.stop_process(nats.pid)
        localservers.stop_process(valkey.pid)


async def new_session(redis_client, task_id: str):
    """One RUNNING session of a new task."""
    (session,) = await running_session(Registry(redis_client), task_id)
    return session


async def running_session(reg: Registry, task_id: str, *, n: int = 1) -> list:
    """Register a task and walk its sessions to RUNNING (as pool + executor would)."""
    _, sessions = await reg.create_task(
        TaskRequest(task_id=task_id, instruction="x", num_samples=n)
    )
    for s in sessions:
        for st in (SessionState.INITIALIZING, SessionState.READY, SessionState.RUNNING):
            assert (await reg.transition(s.session_id, st, node="node0")).ok
    return sessions
