"""Trajectory builder service: ``polar serve builder``.

Consumes ``polar.sessions.finished`` (durable ``builder``), builds each session's
trajectory from ``polar.completions.<session>``, stores it in the object store as
``trajectories/<session>/<attempt>`` and announces ``polar.sessions.built``.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from litestar import Litestar

from schemas import subjects as S
from services.builder.config import BuilderConfig
from services.builder.handlers import Builder
from services.common.bus import work_consumer
from services.common.consumer import Consumer
from services.common.host import ServiceHost
from services.common.http import ops_routes
from services.common.logs import service_logging
from services.common.settings import load


def consumers(builder: Builder) -> list[Consumer]:
    cfg = builder.config
    finished = work_consumer(
        S.CONSUMER_BUILDER,
        S.SESSIONS_FINISHED,
        ack_wait=cfg.ack_wait_seconds,
        max_deliver=cfg.max_deliver,
    )
    return [
        Consumer(
            builder.bus,
            S.STREAM_SESSIONS,
            finished,
            builder.on_finished,
            concurrency=cfg.concurrency,
        )
    ]


def create_app(config: BuilderConfig | None = None) -> Litestar:
    cfg = config or load(BuilderConfig)
    host = ServiceHost("builder", cfg)

    @asynccontextmanager
    async def lifespan(app: Litestar):
        await host.start()
        builder = Builder(host.bus, host.registry, cfg)
        app.state.builder = builder
        for c in consumers(builder):
            host.consume(c)
        try:
            yield
        finally:
            await host.stop()

    return Litestar(
        route_handlers=[*ops_routes("builder", host.health)],
        lifespan=[lifespan],
        logging_config=service_logging(),
    )
