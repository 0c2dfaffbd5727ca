"""Service settings: a frozen msgspec Struct per service, loaded from the environment.

``polar up`` / ``polar serve`` pass a service its settings as JSON in ``POLAR_CONFIG``;
``POLAR_NATS_URL`` and ``POLAR_REDIS_URL`` override the connection URLs (their forms:
``services/common/endpoints.py``), ``POLAR_NATS_REPLICAS`` the streams' replica count. Unknown keys
are an error (a typo in topology.yaml must not be silently ignored).
"""

from __future__ import annotations

import os
from typing import TypeVar

import msgspec

T = TypeVar("T")

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class ConfigError(ValueError):
    pass


class ServiceSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    nats_url: str = DEFAULT_NATS_URL
    redis_url: str = DEFAULT_REDIS_URL
    host: str = "127.0.0.1"
    port: int = 0
    node: str = "node0"
    # how often a service checks that the registry still holds its epoch marker
    registry_check_seconds: float = 1.0
    nats_replicas: int = 1  # copies of each stream / store (3 on a 3-node JetStream cluster)


def load(cls: type[T], env: dict[str, str] | None = None) -> T:
    env = os.environ if env is None else env
    raw = env.get("POLAR_CONFIG") or "{}"
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"POLAR_CONFIG is not JSON: {exc}") from None
    for key, var in (("nats_url", "POLAR_NATS_URL"), ("redis_url", "POLAR_REDIS_URL")):
        if env.get(var):
            data[key] = env[var]
    if env.get("POLAR_NATS_REPLICAS"):
        try:
            data["nats_replicas"] = int(env["POLAR_NATS_REPLICAS"])
        except ValueError:
            raise ConfigError("POLAR_NATS_REPLICAS is not a whole number") from None
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None
