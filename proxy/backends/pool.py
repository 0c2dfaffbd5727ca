"""Several workers behind one ``Backend``: session affinity, health, fail-over.

* Affinity: a session goes to its rendezvous-hash first choice among healthy workers
  (``placement``), so its KV prefix cache is reused; only a dead worker's sessions move.
* Health: ``GET /health`` every ``health_interval_s``; ``failure_threshold`` misses in a
  row mark a worker down. A connection failure during a request marks it down at once.
* Fail-over: a request whose worker is unreachable or answers 502/503 (kind
  ``unavailable``) is retried once on the session's next worker; only a worker that gave
  no answer at all is marked down (a 503 is left to the health check). Other errors are
  the engine's answer and are returned.
* Recovery: a worker that answers health again is re-admitted after it is brought to the
  pool's state: the last weights (if its version differs) and the pause state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from proxy.backends import control, placement
from proxy.backends.base import (
    Backend,
    BackendError,
    Capabilities,
    ChatRequest,
    ErrorKind,
    Generation,
    TokenRequest,
)
from proxy.backends.probe import ProbeIds
from services.common.tasks import cancel_and_wait

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Worker:
    backend: Backend
    up: bool = False
    misses: int = 0

    @property
    def name(self) -> str:
        return self.backend.base_url


class BackendPool:
    def __init__(
        self,
        backends: Sequence[Backend],
        *,
        health_interval_s: float = 2.0,
        failure_threshold: int = 2,
    ) -> None:
        if not backends:
            raise ValueError("a backend pool needs at least one worker")
        self.workers = {b.base_url: Worker(b) for b in backends}
        if len(self.workers) != len(backends):
            raise ValueError("worker base URLs must be distinct")
        self.base_url = ",".join(self.workers)
        self.health_interval_s = health_interval_s
        self.failure_threshold = failure_threshold
        self.failovers = 0
        self._paused = False
        self._weights: tuple[str, str | None] | None = None  # last (path, version) pushed
        self._task: asyncio.Task | None = None

    # -- placement --------------------------------------------------------------------

    def healthy(self) -> list[str]:
        return [name for name, w in self.workers.items() if w.up]

    def worker_for(self, session_id: str) -> str | None:
        return placement.place(session_id, self.healthy())

    def mark_down(self, name: str, reason: str) -> None:
        worker = self.workers[name]
        if worker.up:
            log.warning("backend worker %s down: %s", name, reason)
        worker.up = False
        worker.misses = self.failure_threshold

    # -- generation with fail-over ------------------------------------------------------

    async def chat(self, req: ChatRequest) -> Generation:
        return await self._routed(req.session_id, lambda b: b.chat(req))

    async def generate(self, req: TokenRequest) -> Generation:
        return await self._routed(req.session_id, lambda b: b.generate(req))

    async def _routed(self, session_id: str, call: Callable[[Backend], Awaitable[T]]) -> T:
        tried: list[str] = []
        last: BackendError | None = None
        while len(tried) < 2:  # the session's worker, then once its next choice
            name = placement.place(session_id, [w for w in self.healthy() if w not in tried])
            if name is None:
                break
            if tried:
                self.failovers += 1
            try:
                return await call(self.workers[name].backend)
            except BackendError as exc:
                if exc.kind is not ErrorKind.UNAVAILABLE:
                    raise
                if exc.status is None:  # no answer at all: the worker is gone
                    self.mark_down(name, exc.message)
                tried.append(name)
                last = exc
        raise last or BackendError(ErrorKind.UNAVAILABLE, f"no healthy worker in {self.base_url}")

    # -- start-up and health ----------------------------------------------------------

    async def probe(self, input_ids: ProbeIds | None = None) -> Capabilities:
        """Probe every worker; a capability refusal from any of them refuses the pool."""
        names = list(self.workers)
        results = await asyncio.gather(
            *(self.workers[n].backend.probe(input_ids) for n in names), return_exceptions=True
        )
        found: list[Capabilities] = []
        for name, result in zip(names, results, strict=True):
            if isinstance(result, Capabilities):
                self.workers[name].up, self.workers[name].misses = True, 0
                found.append(result)
            elif isinstance(result, BackendError) and result.kind is ErrorKind.UNAVAILABLE:
                self.mark_down(name, result.message)
            else:
                raise result
        if not found:
            raise BackendError(ErrorKind.UNAVAILABLE, f"no worker of {self.base_url} answered")
        models = {c.model for c in found}
        if len(models) > 1:
            raise BackendError(ErrorKind.CAPABILITY, f"workers serve different models: {models}")
        return msgspec.structs.replace(found[0], base_url=self.base_url, workers=len(found))

    async def health(self) -> bool:
        return bool(self.healthy())

    def start(self) -> None:
        """Run health checks in the background until ``aclose``."""
        if self._task is None:
            self._task = asyncio.create_task(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # never let one bad round stop health checking
                log.exception("backend health round failed")

    async def check_health(self) -> None:
        workers = list(self.workers.values())
        answers = await asyncio.gather(*(w.backend.health() for w in workers))
        for worker, ok in zip(workers, answers, strict=True):
            if not ok:
                worker.misses += 1
                if worker.up and worker.misses >= self.failure_threshold:
                    self.mark_down(worker.name, "health check failed")
            elif not worker.up:
                await self._readmit(worker)
            else:
                worker.misses = 0

    async def _readmit(self, worker: Worker) -> None:
        """Bring a recovered worker to the pool's weights and pause state, then use it."""
        try:
            if self._weights is not None:
                path, version = self._weights
                if await worker.backend.weight_version() != version:
                    await worker.backend.update_weights_from_disk(path, version)
            if self._paused:
                await worker.backend.pause()
        except BackendError as exc:
            log.warning("backend worker %s not re-admitted: %s", worker.name, exc.message)
            return
        worker.up, worker.misses = True, 0
        log.info("backend worker %s up", worker.name)

    # -- weight-update control (all healthy workers) ----------------------------------

    def _up_backends(self) -> list[Backend]:
        return [w.backend for w in self.workers.values() if w.up]

    async def pause(self) -> None:
        self._paused = True
        await control.broadcast(self._up_backends(), lambda b: b.pause())

    async def resume(self) -> None:
        self._paused = False
        await control.broadcast(self._up_backends(), lambda b: b.resume())

    async def update_weights_from_disk(self, path: str, version: str | None = None) -> str | None:
        versions = await control.broadcast(
            self._up_backends(), lambda b: b.update_weights_from_disk(path, version)
        )
        agreed = control.agreed_version(versions)
        self._weights = (path, agreed)
        return agreed

    async def flush_cache(self) -> None:
        await control.broadcast(self._up_backends(), lambda b: b.flush_cache())

    async def weight_version(self) -> str | None:
        versions = await control.broadcast(self._up_backends(), lambda b: b.weight_version())
        return control.agreed_version(versions)

    async def aclose(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        await asyncio.gather(*(w.backend.aclose() for w in self.workers.values()))
