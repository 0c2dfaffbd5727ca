from __future__ import annotations

from schemas.topology import Backend
from services.node.settings import NodeSettings


class PoolConfig(NodeSettings, frozen=True, kw_only=True):
    port: int = 8110
    prefetch: int = 256  # init work items held (and kept alive) to order by priority
    # Engine backpressure (services/pool/backpressure.py): every poll the engines'
    # /metrics queues are read; INIT backs off while their mean is above
    # backpressure_queue, until it is at or below backpressure_resume. No engine: off
    # (polar:backpressure, set by another pool or by hand, is still obeyed).
    engine_urls: list[str] = []  # engines to watch (base URLs)
    backends: list[Backend] = []  # topology.yaml's `backends`: their URLs too
    backpressure_queue: float = 16.0  # waiting requests per engine
    backpressure_resume: float = 4.0  # INIT resumes at or below this
    backpressure_ttl_seconds: float = 5.0  # the key outlives a pool that dies backing off
    backpressure_poll_seconds: float = 0.5  # how often the engines' queues are read

    def watched_engines(self) -> list[str]:
        urls = [*self.engine_urls, *(b.base_url for b in self.backends)]
        return list(dict.fromkeys(urls))  # one engine listed twice is watched once
