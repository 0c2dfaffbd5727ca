"""Engine backpressure: the pool backs off INIT while the inference engines queue work.

Every ``backpressure_poll_seconds`` the pool reads each engine's waiting-request gauge
from its Prometheus ``/metrics``: SGLang's ``sglang:num_queue_reqs`` (the embedded engine
serves the same name), vLLM's ``vllm:num_requests_waiting``. It backs off while the mean
queue over the engines that answered is above ``backpressure_queue`` and resumes once it
is at or below ``backpressure_resume`` (hysteresis, so admission does not flap around one
value). Sessions already prepared keep flowing: only new INITs wait, so the engine gets
no new agents while it cannot serve the ones it has.

While backing off the pool sets ``polar:backpressure`` with a TTL (renewed each poll;
deleted on resume), and every pool checks that key before admitting: pools that watch no
engine hold INIT too, and an operator can set it by hand. An engine that does not answer
gives no signal: the proxy fails over, and a monitoring hiccup must not stop the pipeline.
Polls log at DEBUG only; an engine that answers 404 has no metrics endpoint and never
will, so it is dropped from the watch with one warning instead of being asked twice a
second for the rest of the run.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from schemas import subjects as S

log = logging.getLogger(__name__)
QUEUE_METRICS = ("sglang:num_queue_reqs", "vllm:num_requests_waiting")


def queue_length(text: str) -> float | None:
    """Waiting requests on one ``/metrics`` page (summed over label sets, e.g. one per
    model or data-parallel rank); None when the page has no queue gauge."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        if "{" in line:
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        if name.strip() not in QUEUE_METRICS:
            continue
        try:
            total += float(rest.split()[0])  # a sample may carry a timestamp after it
        except (IndexError, ValueError):
            continue
        seen = True
    return total if seen else None


def struggling(queues: list[float | None], *, high: float, low: float, was: bool) -> bool:
    """Back off now? ``queues``: per engine, None where it gave no signal."""
    known = [q for q in queues if q is not None]
    if not known:
        return False
    mean = sum(known) / len(known)
    return mean > low if was else mean > high


class EngineWatch:
    """Reads the engines' queues and keeps ``polar:backpressure`` set while they struggle."""

    def __init__(
        self,
        redis,
        urls: list[str],
        *,
        high: float,
        low: float,
        ttl_seconds: float,
        timeout: float = 2.0,
    ) -> None:
        self.redis, self.urls = redis, [u.rstrip("/") for u in urls]
        self.unwatched: list[str] = []  # engines without a /metrics endpoint
        self.high, self.low, self.ttl_ms = high, low, max(1, int(ttl_seconds * 1000))
        self.backing_off = False
        self.queues: list[float | None] = []
        self._timeout = timeout
        self._client: httpx.AsyncClient | None = None

    async def poll(self) -> bool:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout)
        self.queues = list(await asyncio.gather(*(self._queue(u) for u in self.urls)))
        if self.unwatched:
            self.urls = [u for u in self.urls if u not in self.unwatched]
        was = self.backing_off
        self.backing_off = struggling(self.queues, high=self.high, low=self.low, was=was)
        if self.backing_off:
            reason = f"engine queues {self.queues} above {self.high:g}"
            await self.redis.set(S.KEY_BACKPRESSURE, reason, px=self.ttl_ms)
            if not was:
                log.warning("backing off INIT: %s", reason)
        elif was:
            await self.redis.delete(S.KEY_BACKPRESSURE)  # resume now, not at the TTL
            log.info("engine queues %s: INIT resumes", self.queues)
        return self.backing_off

    async def _queue(self, url: str) -> float | None:
        try:
            r = await self._client.get(f"{url}/metrics")
        except httpx.HTTPError as exc:
            log.debug("no engine load from %s: %s", url, exc)
            return None
        if r.status_code == 404:
            self.unwatched.append(url)
            log.warning(
                "engine %s has no /metrics (404): its queue is not watched for backpressure", url
            )
            return None
        if r.status_code != 200:
            log.debug("no engine load from %s: HTTP %d", url, r.status_code)
            return None
        queue = queue_length(r.text)
        log.debug("engine %s: %s waiting", url, queue)
        return queue

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
