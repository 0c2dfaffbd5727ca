"""Runtime pool service (INIT stage of one node): ``polar serve pool``."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from functools import partial

from litestar import Litestar

from services.common.host import ServiceHost
from services.common.http import ops_routes
from services.common.logs import service_logging
from services.common.node import node_runtime
from services.common.settings import load
from services.executor.harnesses import default_registry
from services.executor.reaper import Reaper, sweep_leftovers
from services.pool.config import PoolConfig
from services.pool.handlers import RuntimePool


def create_app(config: PoolConfig | None = None) -> Litestar:
    cfg = config or load(PoolConfig)
    host = ServiceHost("pool", cfg)

    @asynccontextmanager
    async def lifespan(app: Litestar):
        await host.start()
        pool = RuntimePool(host.bus, host.registry, cfg, default_registry())
        app.state.pool = pool
        subs = await pool.subscribe()
        runtime_for = partial(node_runtime, cfg)
        # What a dead predecessor left on this node, before this pool admits anything.
        await sweep_leftovers(host.registry, cfg.work_dir, cfg.node, runtime_for, admitting=False)
        host.run(pool.run, "pool")
        host.every(cfg.lease_seconds / 3, pool.renew_leases, "leases")
        await pool.heartbeat()
        host.every(cfg.heartbeat_seconds, pool.heartbeat, "heartbeat")
        reaper = Reaper(
            host.registry,
            host.bus,
            runtime_for,
            keep=pool.initializing.__contains__,
            orphan_after=cfg.lease_seconds,
        )
        host.every(cfg.lease_seconds / 2, reaper.reap, "reaper")
        watch = pool.engine_watch()
        if watch is not None:
            host.every(cfg.backpressure_poll_seconds, watch.poll, "backpressure")
        host.every(cfg.backpressure_poll_seconds, _dispatch(pool), "dispatch")
        try:
            yield
        finally:
            pool.stop()
            for sub in subs:
                await sub.unsubscribe()
            await host.stop()
            if watch is not None:
                await watch.close()

    return Litestar(
        route_handlers=ops_routes("pool", host.health),
        lifespan=[lifespan],
        logging_config=service_logging(),
    )


def _dispatch(pool: RuntimePool):
    async def job() -> None:  # bounds may have freed without an event (a run ended)
        await pool.dispatch()
        await asyncio.sleep(0)

    return job
