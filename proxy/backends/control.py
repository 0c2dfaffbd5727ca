"""Weight-update control passed through to every worker of a backend.

The trainer's sequence (pause -> update weights from disk -> flush cache -> resume) must
reach all workers; one failing worker fails the step, naming the worker. After an update
the workers must agree on the weight version, or the step fails rather than letting
sessions silently sample from mixed weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from proxy.backends.base import Backend, BackendError, ErrorKind

T = TypeVar("T")


async def broadcast(backends: Sequence[Backend], op: Callable[[Backend], Awaitable[T]]) -> list[T]:
    """Run ``op`` on every backend at once; all must succeed."""
    if not backends:
        raise BackendError(ErrorKind.UNAVAILABLE, "no healthy workers to control")
    results = await asyncio.gather(*(op(b) for b in backends), return_exceptions=True)
    failed: list[tuple[Backend, BackendError]] = []
    for backend, result in zip(backends, results, strict=True):
        if isinstance(result, BackendError):
            failed.append((backend, result))
        elif isinstance(result, BaseException):
            raise result  # a bug, not an engine answer
    if failed:
        raise combined(failed)
    return results  # type: ignore[return-value]


def combined(failed: list[tuple[Backend, BackendError]]) -> BackendError:
    first = failed[0][1]
    message = "; ".join(f"{b.base_url}: {e.message}" for b, e in failed)
    return BackendError(
        first.kind,
        message,
        status=first.status,
        retryable=first.retryable,
        worker=failed[0][0].base_url,
    )


def agreed_version(versions: Sequence[str | None]) -> str | None:
    distinct = set(versions)
    if len(distinct) > 1:
        raise BackendError(
            ErrorKind.BAD_RESPONSE,
            f"workers disagree on the weight version: {list(versions)}",
            retryable=False,
        )
    return next(iter(distinct), None)
