"""Harness executor service (RUNNING stage of one node): ``polar serve executor``."""

from __future__ import annotations

from functools import partial

from litestar import Litestar

from schemas import subjects as S
from services.common.bus import ensure_consumer, evaluation_queue, work_consumer
from services.common.consumer import Consumer
from services.common.host import Declared, Every, ServiceHost, service_app
from services.common.settings import load
from services.executor.config import ExecutorConfig
from services.executor.handlers import Executor
from services.node.harnesses import default_registry
from services.node.reaper import Reaper, sweep_leftovers
from services.node.session import node_runtime


def ready_consumer(executor: Executor) -> Consumer:
    cfg = executor.config
    # ack_wait follows the lease: the hand-overs a dead executor held come back to its
    # successor about when the reaper ends or retries their sessions (the consumer keeps
    # a live one's messages in progress every ack_wait / 3).
    config = work_consumer(
        S.consumer_executor(cfg.node),
        S.sessions_ready(cfg.node),
        ack_wait=max(cfg.lease_seconds, 1.0),
        max_deliver=3,
        max_ack_pending=cfg.max_run,
    )
    return Consumer(
        executor.bus, S.STREAM_SESSIONS, config, executor.on_ready, concurrency=cfg.max_run
    )


def create_app(config: ExecutorConfig | None = None) -> Litestar:
    cfg = config or load(ExecutorConfig)

    async def build(host: ServiceHost) -> Declared:
        executor = Executor(host.bus, host.registry, cfg, default_registry())
        subs = await executor.subscribe()
        # The queue of this node's sessions evaluated in the runtimes it leaves: there
        # before any is left, even on a node with no evaluator of its own
        await ensure_consumer(host.bus.js, S.STREAM_SESSIONS, evaluation_queue(cfg.node))
        runtime_for = partial(node_runtime, cfg)
        # What a dead predecessor left on this node (the pool may be admitting meanwhile:
        # what it starts is leased, and INITIALIZING here, before its directory exists).
        await sweep_leftovers(host.registry, cfg.work_dir, cfg.node, runtime_for)
        reaper = Reaper(
            host.registry,
            host.bus,
            runtime_for,
            keep=executor.running.__contains__,
            orphan_after=cfg.lease_seconds,
        )
        return Declared(
            executor,
            consumers=[ready_consumer(executor)],
            jobs=[
                Every(cfg.lease_seconds / 3, executor.renew_leases, "leases"),
                Every(cfg.heartbeat_seconds, executor.heartbeat, "heartbeat", first=True),
                Every(cfg.lease_seconds / 2, reaper.reap, "reaper"),
            ],
            on_stop=[sub.unsubscribe for sub in subs],
        )

    return service_app("executor", cfg, build)
