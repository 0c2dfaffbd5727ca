"""The CLI's connections: they fail fast with one message (the CLI is interactive, so no
minute-long retries as in the services)."""

from __future__ import annotations

import nats
import redis.exceptions

from services.cli.context import Unreachable
from services.common.bus import REFUSED_HINT, Bus, is_auth_error, refused
from services.common.endpoints import nats_servers, redis_client
from services.common.redact import redact
from services.common.registry import Registry

__all__ = ["Unreachable", "open_bus", "open_registry"]


async def _quiet_error(_: Exception) -> None:
    pass  # the caller reports the failure once, as Unreachable


async def open_bus(url: str, name: str = "polar-cli") -> Bus:
    try:
        nc = await nats.connect(
            nats_servers(url),
            name=name,
            connect_timeout=2,
            allow_reconnect=False,
            max_reconnect_attempts=1,  # nats-py 2.16: 0 retries the first connect forever
            error_cb=_quiet_error,
        )
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        if is_auth_error(exc):  # what to do about it, not "cannot reach"
            raise Unreachable(str(refused(url, exc))) from None
        raise Unreachable(
            f"cannot reach NATS at {redact(url)}: {exc or type(exc).__name__}"
        ) from None
    return Bus(nc, nc.jetstream(timeout=5))


async def open_registry(url: str) -> Registry:
    client = redis_client(url, socket_connect_timeout=2, socket_timeout=5)
    try:
        await client.ping()
    except redis.exceptions.AuthenticationError as exc:
        await client.aclose()
        raise Unreachable(
            f"Redis at {redact(url)} refused this client's password ({exc}): {REFUSED_HINT}"
        ) from None
    except (redis.exceptions.RedisError, OSError) as exc:
        await client.aclose()
        raise Unreachable(f"cannot reach Redis at {redact(url)}: {exc}") from None
    return Registry(client)
