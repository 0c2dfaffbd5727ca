"""What every service process shares: connections, consumers, periodic jobs, health.

A service's ``main.py`` builds a Litestar app whose lifespan starts a ``ServiceHost``;
the consumers and periodic jobs run as tasks on the app's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from services.common.bus import Bus
from services.common.consumer import Consumer
from services.common.metrics import SERVICE_UP
from services.common.registry import Registry
from services.common.settings import ServiceSettings

log = logging.getLogger(__name__)


class ServiceHost:
    def __init__(self, name: str, settings: ServiceSettings) -> None:
        self.name, self.settings = name, settings
        self.bus: Bus | None = None
        self.registry: Registry | None = None
        self._consumers: list[Consumer] = []
        self._tasks: list[asyncio.Task] = []

    async def start(self, *, with_registry: bool = True) -> None:
        self.bus = await Bus.open(self.settings.nats_url, f"polar-{self.name}")
        if with_registry:
            self.registry = Registry.from_url(self.settings.redis_url, publish=self.publish)
            await self.registry.redis.ping()
        SERVICE_UP.labels(self.name).set(1)

    async def publish(self, subject: str, payload: bytes, msg_id: str | None = None):
        assert self.bus is not None
        return await self.bus.publish(subject, payload, msg_id=msg_id)

    def consume(self, consumer: Consumer) -> None:
        self._consumers.append(consumer)
        self.run(consumer.run, consumer.name)

    def every(self, seconds: float, job: Callable[[], Awaitable[None]], name: str) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(seconds)
                try:
                    await job()
                except Exception:  # noqa: BLE001 - a periodic job must keep running
                    log.exception("%s: periodic job %s failed", self.name, name)

        self.run(loop, name)

    def run(self, run: Callable[[], Awaitable[None]], name: str) -> None:
        """Keep ``run()`` going as a task of this service; restart it if it crashes."""

        async def guarded() -> None:
            while True:  # a crashed loop restarts instead of going silent
                try:
                    await run()
                    return
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001
                    log.exception("%s: %s crashed; restarting", self.name, name)
                    await asyncio.sleep(1.0)

        self._tasks.append(asyncio.create_task(guarded(), name=name))

    async def health(self) -> dict[str, object]:
        checks: dict[str, object] = {}
        checks["nats"] = bool(self.bus and self.bus.nc.is_connected)
        if self.registry is not None:
            try:
                checks["redis"] = bool(await asyncio.wait_for(self.registry.redis.ping(), 1.0))
            except Exception:  # noqa: BLE001 - health reports, never raises
                checks["redis"] = False
        checks["workers"] = all(not t.done() for t in self._tasks)
        return checks

    async def stop(self) -> None:
        for c in self._consumers:
            c.stop()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        SERVICE_UP.labels(self.name).set(0)
        if self.registry:
            await self.registry.close()
        if self.bus:
            await self.bus.close()
