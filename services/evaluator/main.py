"""Evaluator service: ``polar serve evaluator``.

Consumes ``polar.sessions.built`` (durable ``evaluator``), evaluates each session's
trajectory with the task's evaluator (in the live runtime, a fresh one, or none),
delivers the scored trajectory to ``polar.trajectories.<task>`` exactly once, and moves
the session to its final state with the reward. Runs on the node whose runtimes it
evaluates in (same ``work_dir`` and ``docker_host`` as that node's pool and executor).
"""

from __future__ import annotations

from litestar import Litestar

from schemas import subjects as S
from services.common.bus import work_consumer
from services.common.consumer import Consumer
from services.common.host import Declared, ServiceHost, service_app
from services.common.settings import load
from services.evaluator.config import EvaluatorConfig
from services.evaluator.handlers import EvaluatorService


def consumers(service: EvaluatorService) -> list[Consumer]:
    cfg = service.config
    built = work_consumer(
        S.CONSUMER_EVALUATOR,
        S.SESSIONS_BUILT,
        ack_wait=cfg.ack_wait_seconds,
        max_deliver=cfg.max_deliver,
    )
    return [
        Consumer(
            service.bus, S.STREAM_SESSIONS, built, service.on_built, concurrency=cfg.concurrency
        )
    ]


def create_app(config: EvaluatorConfig | None = None) -> Litestar:
    cfg = config or load(EvaluatorConfig)

    async def build(host: ServiceHost) -> Declared:
        service = EvaluatorService(host.bus, host.registry, cfg)
        return Declared(service, consumers=consumers(service))

    return service_app("evaluator", cfg, build)
