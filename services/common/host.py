"""What every service process shares: connections, consumers, periodic jobs, health.

A service declares what it runs (``Declared``: its consumers, loops, periodic jobs and
what to undo at stop) in a ``build(host)`` function; ``service_app`` turns that into the
Litestar app whose lifespan starts the ``ServiceHost``, runs the declaration as tasks on
the app's event loop and stops it all in reverse.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from litestar import Litestar

from services.common import outbox
from services.common.bus import Bus
from services.common.consumer import Consumer
from services.common.http import ops_routes
from services.common.logs import service_logging
from services.common.metrics import SERVICE_UP
from services.common.registry import Registry
from services.common.settings import ServiceSettings
from services.common.tasks import cancel_and_wait

log = logging.getLogger(__name__)

Job = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class Every:
    """A periodic job: ``job()`` every ``seconds``; ``first``: once at start-up too."""

    seconds: float
    job: Job
    name: str
    first: bool = False


@dataclass
class Declared:
    """What one service runs, declared by its ``build(host)`` (see ``service_app``)."""

    state: Any  # the service object, kept as ``app.state.<service name>``
    consumers: Sequence[Consumer] = ()
    loops: Sequence[tuple[str, Job]] = ()  # long-running coroutines, restarted if they crash
    jobs: Sequence[Every] = ()
    on_stop: Sequence[Callable[[], Awaitable[None] | None]] = field(default_factory=list)


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
        self.bus = await Bus.open(
            self.settings.nats_url,
            f"polar-{self.name}",
            replicas=self.settings.nats_replicas,
            retention=self.settings.retention,
        )
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

    async def publish(self, subject: str, payload: bytes, msg_id: str | None = None) -> None:
        """The registry's state-change events (``Bus.send``: the lean path)."""
        assert self.bus is not None
        await self.bus.send(subject, payload, msg_id=msg_id)

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
        await self.stop_tasks()
        await self.close()

    async def stop_tasks(self) -> None:
        for c in self._consumers:
            c.stop()
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        SERVICE_UP.labels(self.name).set(0)

    async def close(self) -> None:
        if self.registry:
            await self.registry.close()
        if self.bus:
            await self.bus.close()


async def _undo(steps: Sequence[Callable[[], Awaitable[None] | None]]) -> None:
    for step in steps:
        result = step()
        if result is not None:
            await result


def service_app(
    name: str,
    settings: ServiceSettings,
    build: Callable[[ServiceHost], Awaitable[Declared]],
    *,
    routes: Sequence[Any] = (),
    with_registry: bool = True,
    **litestar: Any,
) -> Litestar:
    """The Litestar app of a service: ops routes (``/healthz``, ``/metrics``) plus
    ``routes``; its lifespan connects, runs what ``build`` declared, and stops it."""
    host = ServiceHost(name, settings)

    @asynccontextmanager
    async def lifespan(app):
        await host.start(with_registry=with_registry)
        declared: Declared | None = None
        try:
            declared = await build(host)
            setattr(app.state, name, declared.state)
            for consumer in declared.consumers:
                host.consume(consumer)
            for loop_name, loop in declared.loops:
                host.run(loop, loop_name)
            for every in declared.jobs:
                if every.first:
                    await every.job()
                host.every(every.seconds, every.job, every.name)
            if host.registry is not None:  # every such service relays: any one up suffices
                registry, bus = host.registry, host.bus
                host.every(outbox.RELAY_EVERY_S, lambda: outbox.relay(registry, bus), "outbox")
            yield
        finally:
            # The declared tasks first, then the service's own undo (it may still need
            # the bus, e.g. to unsubscribe), then the connections.
            await host.stop_tasks()
            await _undo(declared.on_stop if declared else ())
            await host.close()

    litestar.setdefault("logging_config", service_logging())
    return Litestar(
        route_handlers=[*routes, *ops_routes(name, host.health)],
        lifespan=[lifespan],
        **litestar,
    )
