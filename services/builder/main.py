"""Trajectory builder service: ``polar serve builder``.

Consumes ``polar.sessions.finished`` (durable ``builder``), builds each session's
trajectory from ``polar.completions.<session>``, stores it in the object store as
``trajectories/<session>/<attempt>`` and announces it on ``polar.sessions.built.any``, or
``polar.sessions.built.node.<node>`` when a runtime for its evaluation waits on the node.
"""

from __future__ import annotations

from litestar import Litestar

from schemas import subjects as S
from services.builder.config import BuilderConfig
from services.builder.handlers import Builder
from services.common.bus import work_consumer
from services.common.consumer import Consumer
from services.common.host import Declared, ServiceHost, service_app
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
            on_quarantine=builder.on_quarantined,
            give_up=builder.give_up,
        )
    ]


def create_app(config: BuilderConfig | None = None) -> Litestar:
    cfg = config or load(BuilderConfig)

    async def build(host: ServiceHost) -> Declared:
        builder = Builder(host.bus, host.registry, cfg)
        return Declared(builder, consumers=consumers(builder))

    return service_app("builder", cfg, build)
