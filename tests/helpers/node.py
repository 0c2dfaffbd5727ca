"""Run a node (runtime pool + executor) and a scheduler in-process against real servers."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from schemas import SessionFinished, SessionStateChanged, decode
from schemas import subjects as S
from services.common.bus import Bus
from services.common.registry import Registry
from services.executor.config import ExecutorConfig
from services.executor.handlers import Executor
from services.executor.harnesses import default_registry
from services.executor.main import ready_consumer
from services.pool.config import PoolConfig
from services.pool.handlers import RuntimePool
from services.scheduler.config import SchedulerConfig
from services.scheduler.handlers import Scheduler


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
    async def start(cls, nats_url: str, redis_url: str, work_dir, **limits) -> Node:
        bus = await Bus.open(nats_url, "test-node")
        reg = Registry.from_url(redis_url, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
        common = dict(nats_url=nats_url, redis_url=redis_url, work_dir=str(work_dir), **limits)
        pool = RuntimePool(bus, reg, PoolConfig(**common), default_registry())
        executor = Executor(bus, reg, ExecutorConfig(**common), default_registry())
        sched = Scheduler(bus, reg, SchedulerConfig(nats_url=nats_url, redis_url=redis_url))
        node = cls(bus, reg, pool, executor, sched)
        await bus.nc.subscribe(S.SESSIONS_FINISHED, cb=node._on_finished)
        await bus.nc.subscribe("polar.control.cancel.*", cb=pool.on_cancel)
        await bus.nc.subscribe("polar.control.cancel.*", cb=executor.on_cancel)
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
        self.pool.stop()
        self.consumer.stop()
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(BaseException):
                await t
        await self.registry.close()
        await self.bus.close()
