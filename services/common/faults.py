"""Faults of the system, not of the task: the bus or the registry unreachable, a timeout
talking to them. (A holder lost, its lease expired, is one too: see ``finish.may_retry``.)
Retried where they happen, boundedly, instead of ending a session or dead-lettering a
message."""

from __future__ import annotations

import nats.errors
import redis.exceptions

REGISTRY_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
TRANSIENT = (nats.errors.Error, *REGISTRY_DOWN, ConnectionError, TimeoutError)


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, TRANSIENT)
