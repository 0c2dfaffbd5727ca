"""``polar serve trainer``: the training loop as a stack service with ``/healthz`` and
Prometheus ``/metrics``; settings from ``POLAR_CONFIG`` like every service.

A finished run keeps serving its metrics (healthy, ``run: done``); a failed one (a logprob
mismatch, a refused task or weight update) ends the process with exit status 3, so a
supervisor sees the failure."""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager

from litestar import Litestar

from services.common.http import ops_routes
from services.common.logs import service_logging
from services.common.settings import load
from services.common.tasks import cancel_and_wait
from services.trainer.config import TrainerConfig
from services.trainer.loop import Trainer

log = logging.getLogger(__name__)
FAILED_EXIT = 3


def create_app(config: TrainerConfig | None = None) -> Litestar:
    cfg = config or load(TrainerConfig)
    trainer = Trainer(cfg)

    async def run() -> None:
        try:
            await trainer.run()
        except Exception as exc:  # noqa: BLE001 - the run failed: say why, exit non-zero
            log.exception("training run failed")
            trainer.error = f"{type(exc).__name__}: {exc}"
            os._exit(FAILED_EXIT)

    @asynccontextmanager
    async def lifespan(app: Litestar):
        task = asyncio.create_task(run(), name="trainer")
        try:
            yield
        finally:
            await cancel_and_wait([task])

    async def health() -> dict[str, object]:
        step = trainer.state.step if hasattr(trainer, "state") else 0
        return {
            "run": {
                "ok": trainer.error is None,
                "done": trainer.done,
                "step": step,
                "error": trainer.error,
            }
        }

    return Litestar(
        route_handlers=ops_routes("trainer", health),
        lifespan=[lifespan],
        logging_config=service_logging(),
    )
