"""What every service process shares: connections, consumers, periodic jobs, health.

A service's ``main.py`` builds a Litestar app whose lifespan starts a ``ServiceHost``;
the consumers and periodic jobs run as tasks on the app's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
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
        self.epoch: str | None = None
        self.registry_lost: str | None = None  # why this service stopped, once it has

    async def start(self, *, with_registry: bool = True) -> None:
        self.bus = await Bus.open(self.settings.nats_url, f"polar-{self.name}")
        if with_registry:
            self.registry = Registry.from_url(self.settings.redis_url, publish=self.publish)
            await self.registry.redis.ping()
            self.epoch = await self.registry.ensure_epoch()
            self.run(self._watch_epoch, "registry-epoch")
        SERVICE_UP.labels(self.name).set(1)

    async def _watch_epoch(self) -> None:
        """Stop this service, loudly, once the registry's epoch marker changes or goes: a
        Redis that restarted empty (no persistence, a flush, another server at the URL)
        would otherwise be filled with fragments of sessions it no longer knows."""
        assert self.registry is not None
        while True:
            await asyncio.sleep(self.settings.registry_check_seconds)
            try:
                now = await self.registry.epoch()
            except Exception:  # noqa: BLE001 - unreachable is an outage, not a loss
                continue
            if now == self.epoch:
                continue
            self.registry_lost = (
                f"the registry lost its state (epoch marker {self.epoch} is "
                f"{'gone' if now is None else f'now {now}'}): sessions it held are gone"
            )
            log.critical(
                "%s: %s; stopping instead of writing fragments into it. Restart "
                "the stack (`polar down && polar up`) once Redis is right",
                self.name,
                self.registry_lost,
            )
            self._stop_process()
            return

    @staticmethod
    def _stop_process() -> None:
        """SIGTERM this service's process group (a granian server is a parent and its
        worker; every ``polar serve`` leads a group of its own): a graceful stop."""
        os.killpg(os.getpgid(0), signal.SIGTERM)

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
        if self.epoch is not None:
            checks["registry_epoch"] = self.registry_lost is None
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
