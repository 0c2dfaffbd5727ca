"""Run a node (runtime pool + executor) and a scheduler in-process against real servers."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson

from schemas import SessionFinished, SessionStateChanged, TaskRequest, decode
from schemas import subjects as S
from services.common.bus import Bus
from services.common.registry import Registry
from services.executor.config import ExecutorConfig
from services.executor.handlers import Executor
from services.executor.main import ready_consumer
from services.node.harnesses import default_registry
from services.pool.config import PoolConfig
from services.pool.handlers import RuntimePool
from services.runtimes.procs import TAG_SESSION, tagged_pids
from services.scheduler.config import SchedulerConfig
from services.scheduler.handlers import Scheduler
from tests.helpers.requires import DOCKER_HOST


@dataclass
class Node:
    bus: Bus
    registry: Registry
    pool: RuntimePool
    executor: Executor
    scheduler: Scheduler
    tasks: list[asyncio.Task] = field(default_factory=list)
    finished: dict[str, SessionFinished] = field(default_factory=dict)

    @classmethod
    async def start(
        cls, nats_url: str, redis_url: str, work_dir, *, executor: dict | None = None, **limits
    ) -> Node:
        """``limits``: node settings for both services; ``executor``: executor-only ones."""
        bus = await Bus.open(nats_url, "test-node")
        reg = Registry.from_url(redis_url, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
        common = dict(nats_url=nats_url, redis_url=redis_url, work_dir=str(work_dir), **limits)
        pool = RuntimePool(bus, reg, PoolConfig(**common), default_registry())
        executor = Executor(
            bus, reg, ExecutorConfig(**common, **(executor or {})), default_registry()
        )
        sched = Scheduler(bus, reg, SchedulerConfig(nats_url=nats_url, redis_url=redis_url))
        node = cls(bus, reg, pool, executor, sched)
        await bus.nc.subscribe(S.SESSIONS_FINISHED, cb=node._on_finished)
        await pool.subscribe()  # cancels, and READY sessions that ended (the pool stops them)
        await executor.subscribe()
        consumer = ready_consumer(executor)
        node.consumer = consumer
        node.tasks = [asyncio.create_task(pool.run()), asyncio.create_task(consumer.run())]
        return node

    async def _on_finished(self, msg) -> None:
        ev = decode(await self.bus.payload(msg), SessionFinished)
        self.finished[ev.session_id] = ev

    async def wait_finished(self, n: int, timeout: float = 120.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while len(self.finished) < n:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{len(self.finished)}/{n} sessions finished")
            await asyncio.sleep(0.05)
            await self.pool.dispatch()

    async def events(self) -> list[SessionStateChanged]:
        """Every state change, in the order Redis applied them."""
        info = await self.bus.js.stream_info(S.STREAM_EVENTS)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            with contextlib.suppress(Exception):
                msg = await self.bus.js.get_msg(S.STREAM_EVENTS, seq)
                out.append(decode(msg.data, SessionStateChanged))
        return sorted(out, key=lambda e: e.seq)

    async def stop(self) -> None:
        """Stop both services; runs and INITs still going are cancelled (runtimes stopped)."""
        self.pool.stop()
        self.consumer.stop()
        for run in self.executor.running.values():
            run.cancel("test node stopping")
        for runtime in list(self.pool.initializing.values()):
            await runtime.cancel()
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(t), STOP_SECONDS)
        stuck = [t for t in self.tasks if not t.done()]
        await self.registry.close()
        await self.bus.close()
        if stuck:  # a service that does not stop: say where it waits, not a bare test timeout
            raise AssertionError(f"node did not stop: {[t.get_name() for t in stuck]}\n{_stacks()}")


STOP_SECONDS = 30.0  # for each of the node's loops to end once cancelled


def _stacks() -> str:
    """Where every other task of the loop waits (a stuck loop waits on one of them)."""
    out = io.StringIO()
    for other in asyncio.all_tasks():
        if other is not asyncio.current_task():
            other.print_stack(limit=8, file=out)
    return out.getvalue()


def task(task_id: str, n: int = 1, **spec) -> TaskRequest:
    """A TaskRequest from plain JSON-like keyword arguments (validated like a submission)."""
    raw = {"task_id": task_id, "instruction": "do the task", "num_samples": n, **spec}
    return decode(orjson.dumps(raw), TaskRequest)


def session_procs(session_id: str) -> list[int]:
    """Live processes started for a session (found by its tag, wherever they moved)."""
    return tagged_pids(TAG_SESSION, session_id)


def proc_state(stat_path: str) -> str | None:
    """The state letter of a /proc ``stat`` file (R, S, T, Z, ...); None when gone."""
    try:
        with open(stat_path, "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return None


def dead(pid: int) -> bool:
    """Gone, or a zombie (holds nothing but its pid until its new parent reaps it)."""
    return proc_state(f"/proc/{pid}/stat") in (None, "Z")


async def wait_until(
    check: Callable[[], Awaitable[object] | object], timeout: float, what: str = "condition"
) -> object:
    """Poll ``check`` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.05)


def leftover_dirs(work_dir) -> list[str]:
    """Session directories still on disk under a node's work dir."""
    root = os.path.join(str(work_dir), "sessions")
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


# -- docker runtime tests (podman's Docker API, started by `just setup`) ----------------
def containers(runtime_ids: list[str]) -> list[str]:
    """Names of the containers (any state) labelled with these runtimes."""
    if DOCKER_HOST is None:
        return []
    import docker

    client = docker.DockerClient(base_url=DOCKER_HOST)
    try:
        return [
            c.name
            for rid in runtime_ids
            for c in client.containers.list(all=True, filters={"label": f"polar.runtime={rid}"})
        ]
    finally:
        client.close()
