"""What every example runner shares: a whole stack on free ports (``polar demo``'s, with
the example's scripted policy), tasks submitted at once and followed to their results,
and what each session left (result, trajectory, seconds per stage)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from infra import credentials, devstack
from infra.topology import parse_topology
from schemas import SessionStateChanged, TaskResult, decode
from schemas import subjects as S
from services.cli.demo import demo_topology

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    """One task's single session: its result, trajectory and state entry times."""

    task: dict
    result: TaskResult | None
    trajectory: dict = field(default_factory=dict)
    entered: dict[str, float] = field(default_factory=dict)

    @property
    def session(self):
        return self.result.sessions[0] if self.result else None

    def seconds(self, start: str, end: str) -> float | None:
        a, b = self.entered.get(start), self.entered.get(end)
        return round(b - a, 1) if a and b else None

    @property
    def wall(self) -> float | None:
        r = self.result
        return round(r.finished_at - r.submitted_at, 1) if r else None


def docker_env() -> None:
    """DOCKER_HOST for the stack's runtimes: the caller's, else what `just setup` wrote."""
    env_file = REPO / ".state" / "test.env"
    if "DOCKER_HOST" not in os.environ and env_file.exists():
        for line in env_file.read_text().splitlines():
            if line.startswith("DOCKER_HOST="):
                os.environ["DOCKER_HOST"] = line.split("=", 1)[1]


def scripted(policy: Path, *, engine: str = "", max_run: int = 3) -> Callable[[Path], str]:
    """``polar demo``'s topology, serving ``policy`` (for :func:`stack`)."""
    return lambda state_dir: demo_topology(state_dir, policy, engine=engine, max_run=max_run)


@contextlib.contextmanager
def stack(topology: Callable[[Path], str], *, log=print) -> Iterator:
    """The stack ``topology(state_dir)`` describes, up for the block (its topology
    yielded, with the URLs the operator's tools sign in with, and the state directory as
    ``topo.state_dir``), then stopped."""
    cache = Path(os.environ.get("POLAR_HARNESS_CACHE", REPO / ".state" / "harness-cache"))
    os.environ["POLAR_HARNESS_CACHE"] = str(cache.absolute())  # the pool inherits it
    docker_env()
    os.chdir(REPO)  # task files name `src` paths relative to the repository
    state_dir = Path(tempfile.mkdtemp(prefix="polar-example-"))
    topo = parse_topology(topology(state_dir), "example topology")
    t0 = time.monotonic()
    devstack.up(topo, log=lambda m: log(f"  {m}"))
    log(f"stack up in {time.monotonic() - t0:.1f}s; state in {state_dir}")
    try:
        yield devstack.operator_view(topo)  # the stack's NATS and Valkey want credentials
    finally:
        if not os.environ.get("POLAR_EXAMPLE_KEEP"):
            devstack.down(state_dir)


def train_addresses(topo) -> dict:
    """What a ``polar train`` config needs of the stack :func:`stack` started: its NATS
    and Valkey URLs with credentials, the proxy, and the admin token weight pushes need."""
    creds = credentials.load(Path(topo.state_dir))
    return {
        "nats_url": topo.nats_url,
        "redis_url": topo.redis_url,
        "admin_token": creds.admin_token if creds else None,
        "proxy_url": f"http://127.0.0.1:{topo.services['proxy'].port}",
    }


async def run_tasks(topo, tasks: list[dict], timeout: float) -> list[Run]:
    """Submit ``tasks`` at once (one session each), wait for every result, read back."""
    from services.cli.submit import BusTasks
    from services.cli.taskfile import Submitted, TaskFile
    from services.common.bus import Bus

    bus = await Bus.open(topo.nats_url, "polar-example", declare=False)
    entered: dict[str, dict[str, float]] = {}

    async def on_state(msg) -> None:
        with contextlib.suppress(Exception):
            ev = decode(await bus.payload(msg), SessionStateChanged)
            entered.setdefault(ev.session_id, {})[str(ev.to_state)] = ev.ts

    sub = await bus.nc.subscribe(S.session_event("*"), cb=on_state)
    clients = []
    try:
        for task in tasks:
            client = await BusTasks.open(topo.nats_url, topo.redis_url)
            clients.append(client)
            answer = await client.submit(TaskFile(orjson.dumps(task), task["task_id"], 1), True)
            if not isinstance(answer, Submitted):
                raise SystemExit(f"{task['task_id']} refused: {answer}")
        results = await asyncio.gather(
            *(
                c.wait(t["task_id"], timeout, lambda *_: None)
                for c, t in zip(clients, tasks, strict=True)
            )
        )
        runs = []
        for task, result in zip(tasks, results, strict=True):
            if result is None:
                runs.append(Run(task, None))
                continue
            sid = result.sessions[0].session_id
            traj = await _trajectory(bus, result.task_id)
            runs.append(Run(task, result, traj, entered.get(sid, {})))
        return runs
    finally:
        await sub.unsubscribe()
        for c in clients:
            await c.close()
        await bus.close()


async def _trajectory(bus, task_id: str) -> dict:
    sub = await bus.js.subscribe(S.trajectories(task_id), ordered_consumer=True)
    try:
        return orjson.loads(await bus.payload(await sub.next_msg(timeout=60)))
    finally:
        await sub.unsubscribe()
