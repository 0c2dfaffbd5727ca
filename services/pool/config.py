from __future__ import annotations

from services.common.settings import ServiceSettings


class NodeSettings(ServiceSettings, frozen=True, kw_only=True):
    """What the pool and the executor of one node share."""

    work_dir: str = ".state/work"  # sessions/<id> (runtimes) and logs/<id> live here
    proxy_url: str = "http://127.0.0.1:8200"  # the proxy as sandboxes reach it
    max_init: int = 4
    ready_buffer: int = 4
    max_run: int = 8
    lease_seconds: float = 30.0
    heartbeat_seconds: float = 5.0  # NodeHeartbeat on polar.nodes.heartbeat and in polar:nodes
    docker_host: str | None = None


class PoolConfig(NodeSettings, frozen=True, kw_only=True):
    port: int = 8110
    prefetch: int = 256  # init work items held (and kept alive) to order by priority
    backpressure_poll_seconds: float = 0.5
