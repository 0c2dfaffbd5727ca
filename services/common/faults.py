"""Faults of the system, not of the task: the bus or the registry unreachable, a timeout
talking to them. (A holder lost, its lease expired, is one too: see ``finish.may_retry``.)
Retried where they happen, boundedly, instead of ending a session or dead-lettering a
message."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import redis.exceptions

T = TypeVar("T")

REGISTRY_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
BUS_DOWN = (nats.errors.Error, ConnectionError, TimeoutError)
TRANSIENT = (*BUS_DOWN, *REGISTRY_DOWN)
# how long work failing on a fault of the system is run again in place before the
# failure counts (as a delivery, or as an attempt): longer than a registry restart
TRANSIENT_WAIT_S = 30.0


def registry_refuses_writes(exc: BaseException) -> bool:
    """A Valkey failover under way: the demoted primary answers READONLY, and a primary
    with fewer replicas following it than ``min-replicas-to-write`` answers NOREPLICAS.
    No holder can renew a lease meanwhile, as when the registry is down."""
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return True
    return isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("NOREPLICAS")


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, TRANSIENT) or registry_refuses_writes(exc)


async def retry_faults(
    call: Callable[[], Awaitable[T]],
    *,
    seconds: float,
    faults: tuple[type[BaseException], ...] = TRANSIENT,
    first_delay: float = 0.25,
    max_delay: float = 4.0,
    on_retry: Callable[[BaseException, float], None] | None = None,
) -> T:
    """``call()``, again while it raises one of ``faults``, backing off from
    ``first_delay`` to ``max_delay``; past ``seconds`` the last fault is raised.
    ``on_retry(exc, delay)`` is told before each wait."""
    deadline, delay = time.monotonic() + seconds, first_delay
    while True:
        try:
            return await call()
        except faults as exc:
            if time.monotonic() + delay > deadline:
                raise
            if on_retry is not None:
                on_retry(exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)
