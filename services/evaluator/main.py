"""Evaluator service: ``polar serve evaluator``.

Consumes ``polar.sessions.built.any`` (durable ``evaluator``, shared by every
evaluator) and, for each node whose runtimes it reaches (``nodes``, default its own),
``polar.sessions.built.node.<node>`` (durable ``evaluator-<node>``): sessions evaluated
in a runtime left on that node. Evaluates each session's trajectory with the task's
evaluator (in the live runtime, a fresh one, or none), delivers the scored trajectory to
``polar.trajectories.<task>`` exactly once, and moves the session to its final state
with the reward. Runs where it reaches its nodes' runtimes (the same ``work_dir`` and
``docker_host`` as their pools and executors). A node queue nobody takes from (its host
gone) is taken over (``orphans``).
"""

from __future__ import annotations

from litestar import Litestar
from nats.js.api import ConsumerConfig

from schemas import subjects as S
from services.common.bus import evaluation_queue, work_consumer
from services.common.consumer import Consumer
from services.common.host import Declared, Every, ServiceHost, service_app
from services.common.settings import load
from services.evaluator.config import EvaluatorConfig
from services.evaluator.handlers import EvaluatorService
from services.evaluator.orphans import OrphanWatch


def consumers(service: EvaluatorService) -> list[Consumer]:
    """The shared queue and this evaluator's nodes' queues, ``concurrency`` sessions
    evaluated at once over all of them."""
    cfg = service.config
    shared = work_consumer(
        S.CONSUMER_EVALUATOR,
        S.SESSIONS_BUILT_ANY,
        ack_wait=cfg.ack_wait_seconds,
        max_deliver=cfg.max_deliver,
    )
    nodes = [_node_queue(cfg, node) for node in cfg.reachable_nodes]
    return [_consumer(service, queue) for queue in [shared, *nodes]]


def node_consumer(service: EvaluatorService, node: str) -> Consumer:
    """Node ``node``'s queue, for a takeover (within the same ``concurrency``)."""
    return _consumer(service, _node_queue(service.config, node))


def _node_queue(cfg: EvaluatorConfig, node: str) -> ConsumerConfig:
    return evaluation_queue(node, ack_wait=cfg.ack_wait_seconds, max_deliver=cfg.max_deliver)


def _consumer(service: EvaluatorService, queue: ConsumerConfig) -> Consumer:
    async def bounded(msg) -> None:
        async with service.slots:
            await service.on_built(msg)

    concurrency = service.config.concurrency
    return Consumer(
        service.bus,
        S.STREAM_SESSIONS,
        queue,
        bounded,
        concurrency=concurrency,
        on_quarantine=service.on_quarantined,
        give_up=service.give_up,
    )


def create_app(config: EvaluatorConfig | None = None) -> Litestar:
    cfg = config or load(EvaluatorConfig)

    async def build(host: ServiceHost) -> Declared:
        service = EvaluatorService(host.bus, host.registry, cfg)

        async def take_over(node: str) -> None:
            await node_consumer(service, node).run(drain=True)

        watch = OrphanWatch(host.bus, cfg.reachable_nodes, cfg.orphan_after_seconds, take_over)
        return Declared(
            service,
            consumers=consumers(service),
            jobs=[Every(cfg.orphan_check_seconds, watch.poll, "orphans")],
        )

    return service_app("evaluator", cfg, build)
