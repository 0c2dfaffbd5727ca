"""The embedded model server as a dev-stack service (``polar up``): settings from
``POLAR_CONFIG`` like every Polar service, plus the ops routes the stack waits on."""

from __future__ import annotations

import os
from collections.abc import Mapping

import msgspec
from litestar import Litestar

from services.common.http import ops_routes
from services.common.settings import ENGINE_KEY_ENV, fill_from_env
from services.engine.app import create_app as create_engine_app
from services.engine.server import ServeConfig, ensure_model_dir

_STACK_KEYS = (
    "nats_url",
    "redis_url",
    "nats_replicas",
    "retention",
    "node",
)  # every stack service gets these; unused here


def service_config(env: Mapping[str, str]) -> ServeConfig:
    """The model service's settings: ``POLAR_CONFIG`` less the stack's keys, the api key
    from ``POLAR_ENGINE_API_KEY`` (a deployment's Secret) unless the config sets one."""
    raw = msgspec.json.decode(env.get("POLAR_CONFIG") or "{}")
    for key in _STACK_KEYS:
        raw.pop(key, None)
    raw = fill_from_env(raw, {"api_key": ENGINE_KEY_ENV}, env)
    return msgspec.convert(raw, ServeConfig)


def create_app() -> Litestar:
    config = service_config(os.environ)
    ensure_model_dir(config.model_dir)
    app = create_engine_app(config)

    async def healthy() -> dict[str, object]:
        return {"engine": True}

    for handler in ops_routes("model", healthy):
        if "/metrics" not in handler.paths:  # the engine serves /metrics itself
            app.register(handler)
    return app
