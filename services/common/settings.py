"""Service settings: a frozen msgspec Struct per service, loaded from the environment.

``polar up`` / ``polar serve`` pass a service its settings as JSON in ``POLAR_CONFIG``;
``POLAR_NATS_URL`` and ``POLAR_REDIS_URL`` override the connection URLs (their forms:
``services/common/endpoints.py``), ``POLAR_NATS_REPLICAS`` the streams' replica count. Unknown keys
are an error (a typo in topology.yaml must not be silently ignored).

Credentials a deployment keeps out of its config (a Secret, an env file) come from the
environment when the config leaves them unset (absent, null or empty): ``POLAR_ADMIN_TOKEN``
and ``POLAR_READ_TOKEN`` for a service whose settings have ``admin_token`` / ``read_token``
(``ENV_TOKENS``), and ``POLAR_ENGINE_API_KEY`` where a service says it presents or checks
the embedded engine's key (``ServiceSettings.with_env_secrets``: the proxy). A token set in
the config always wins: ``polar up`` writes its generated ones there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Self, TypeVar

import msgspec

from schemas import subjects as S

T = TypeVar("T")

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class ConfigError(ValueError):
    pass


DAY = 24 * 3600.0


class StreamLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One JetStream stream's retention: the oldest messages go past either limit."""

    max_age_seconds: float = 0.0  # 0: no age limit
    max_bytes: int = -1  # -1: no size limit


# The stated default policy (docs/configuration.md "Retention"): the streams are bounded
# in age; a size limit is opt-in, since JetStream reserves each stream's max_bytes against
# the server's storage at creation (and refuses a stream that does not fit). The object
# store (claim-checks, built trajectories) has both, and refuses new objects when full
# rather than dropping ones not yet read. POLAR_SESSIONS is a work queue (a message goes
# when acked) and takes no limit: dropping one would lose work.
OBJECT_STREAM = f"OBJ_{S.OBJECT_STORE}"  # the object store's stream
DEFAULT_STREAM_LIMITS: dict[str, StreamLimits] = {
    S.STREAM_TASKS: StreamLimits(max_age_seconds=7 * DAY),
    S.STREAM_EVENTS: StreamLimits(max_age_seconds=3 * DAY),
    S.STREAM_COMPLETIONS: StreamLimits(max_age_seconds=7 * DAY),
    S.STREAM_TRAJECTORIES: StreamLimits(max_age_seconds=14 * DAY),
    S.STREAM_REGRADES: StreamLimits(max_age_seconds=14 * DAY),
    S.STREAM_DLQ: StreamLimits(max_age_seconds=14 * DAY),
    OBJECT_STREAM: StreamLimits(max_age_seconds=14 * DAY, max_bytes=4 << 30),
}


class Retention(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the stack keeps, for how long: one policy for every service (the topology's
    ``retention``), since each service declares the streams at its start."""

    # a task's Redis keys (its record, counts, session list) and its sessions' (record,
    # call numbers) expire this long after the task ended; 0 keeps them forever
    finished_seconds: float = 7 * DAY
    # per stream (POLAR_EVENTS, ..., OBJ_polar-blobs: the object store): overrides of
    # DEFAULT_STREAM_LIMITS, whole entries
    streams: dict[str, StreamLimits] = {}

    def __post_init__(self) -> None:
        if self.finished_seconds < 0:
            raise ValueError("retention.finished_seconds must be >= 0 (0: kept forever)")
        unknown = sorted(set(self.streams) - set(DEFAULT_STREAM_LIMITS))
        if unknown:
            raise ValueError(
                f"retention.streams: no stream {', '.join(unknown)} "
                f"(limits apply to {', '.join(DEFAULT_STREAM_LIMITS)})"
            )

    def limits(self, stream: str) -> StreamLimits | None:
        return self.streams.get(stream) or DEFAULT_STREAM_LIMITS.get(stream)


# settings field -> the environment variable it is taken from when the config leaves it unset
ENV_TOKENS = {"admin_token": "POLAR_ADMIN_TOKEN", "read_token": "POLAR_READ_TOKEN"}
# the embedded engine's api key (services/engine reads it too, as `polar model serve` does)
ENGINE_KEY_ENV = "POLAR_ENGINE_API_KEY"
ENV_SECRETS = (*ENV_TOKENS.values(), ENGINE_KEY_ENV)


def unset(value: object) -> bool:
    """A credential the config does not give: absent, null or empty (an empty token
    matches nothing, services/common/auth.py, so it is no setting to keep)."""
    return value is None or value == ""


def fill_from_env(data: dict, fields: dict[str, str], env: Mapping[str, str]) -> dict:
    """``data`` with each of ``fields`` (field -> env var) that it leaves unset taken
    from the environment, when the variable is set and not empty: the config wins."""
    for field, var in fields.items():
        if unset(data.get(field)) and env.get(var):
            data[field] = env[var]
    return data


class ServiceSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    nats_url: str = DEFAULT_NATS_URL  # NATS (`POLAR_NATS_URL` overrides)
    redis_url: str = DEFAULT_REDIS_URL  # Redis or Valkey (`POLAR_REDIS_URL` overrides)
    host: str = "127.0.0.1"  # where the service listens
    port: int = 0  # its port; 0: any free one
    node: str = "node0"  # the node the service runs for (per-node services) or on
    # how often a service checks that the registry still holds its epoch marker
    registry_check_seconds: float = 1.0
    nats_replicas: int = 1  # copies of each stream / store (3 on a 3-node JetStream cluster)
    retention: Retention = Retention()  # the stack's retention policy (the topology's)

    def with_env_secrets(self, env: Mapping[str, str]) -> Self:
        """These settings with the credentials beyond ``ENV_TOKENS`` that this kind
        takes from ``env`` (``load`` calls it last); none by default."""
        return self


def load(cls: type[T], env: dict[str, str] | None = None) -> T:
    env = os.environ if env is None else env
    raw = env.get("POLAR_CONFIG") or "{}"
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"POLAR_CONFIG is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"POLAR_CONFIG is not a JSON object: {raw[:80]}")
    for key, var in (("nats_url", "POLAR_NATS_URL"), ("redis_url", "POLAR_REDIS_URL")):
        if env.get(var):
            data[key] = env[var]
    if env.get("POLAR_NATS_REPLICAS"):
        try:
            data["nats_replicas"] = int(env["POLAR_NATS_REPLICAS"])
        except ValueError:
            raise ConfigError("POLAR_NATS_REPLICAS is not a whole number") from None
    declared = {f.name for f in msgspec.structs.fields(cls)}
    fill_from_env(data, {k: v for k, v in ENV_TOKENS.items() if k in declared}, env)
    try:
        settings = msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None
    if isinstance(settings, ServiceSettings):
        settings = settings.with_env_secrets(env)
    return settings
