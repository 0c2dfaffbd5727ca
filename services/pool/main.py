"""Runtime pool service (INIT stage of one node): ``polar serve pool``."""

from __future__ import annotations

import asyncio
from functools import partial

from litestar import Litestar

from services.common.host import Declared, Every, ServiceHost, service_app
from services.common.settings import load
from services.node.harnesses import default_registry
from services.node.reaper import Reaper, sweep_leftovers
from services.node.session import node_runtime
from services.pool.config import PoolConfig
from services.pool.handlers import RuntimePool


def create_app(config: PoolConfig | None = None) -> Litestar:
    cfg = config or load(PoolConfig)

    async def build(host: ServiceHost) -> Declared:
        pool = RuntimePool(host.bus, host.registry, cfg, default_registry())
        subs = await pool.subscribe()
        runtime_for = partial(node_runtime, cfg)
        # What a dead predecessor left on this node, before this pool admits anything.
        await sweep_leftovers(host.registry, cfg.work_dir, cfg.node, runtime_for)
        reaper = Reaper(
            host.registry,
            host.bus,
            runtime_for,
            keep=pool.initializing.__contains__,
            orphan_after=cfg.lease_seconds,
        )
        jobs = [
            Every(cfg.lease_seconds / 3, pool.renew_leases, "leases"),
            Every(cfg.heartbeat_seconds, pool.heartbeat, "heartbeat", first=True),
            Every(cfg.lease_seconds / 2, reaper.reap, "reaper"),
        ]
        watch = pool.engine_watch()
        if watch is not None:
            jobs.append(Every(cfg.backpressure_poll_seconds, watch.poll, "backpressure"))
        jobs.append(Every(cfg.backpressure_poll_seconds, _dispatch(pool), "dispatch"))
        return Declared(
            pool,
            loops=[("pool", pool.run)],
            jobs=jobs,
            on_stop=[
                pool.stop,
                *(sub.unsubscribe for sub in subs),
                *([watch.close] if watch else []),
            ],
        )

    return service_app("pool", cfg, build)


def _dispatch(pool: RuntimePool):
    async def job() -> None:  # bounds may have freed without an event (a run ended)
        await pool.dispatch()
        await asyncio.sleep(0)

    return job
