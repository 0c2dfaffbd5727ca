from __future__ import annotations

from schemas.topology import NODE_DEFAULTS
from services.common.settings import ServiceSettings


class NodeSettings(ServiceSettings, frozen=True, kw_only=True):
    """What the pool and the executor of one node share."""

    work_dir: str = ".state/work"  # sessions/<id> (runtimes) and logs/<id> live here
    proxy_url: str = "http://127.0.0.1:8200"  # the proxy as sandboxes reach it
    max_init: int = NODE_DEFAULTS.max_init  # sandboxes being prepared at once (the node's bound)
    ready_buffer: int = NODE_DEFAULTS.ready_buffer  # prepared sandboxes waiting for a run slot
    max_run: int = NODE_DEFAULTS.max_run  # harnesses running at once
    # a held session's lease, renewed while held: lapsed, the session is reaped
    lease_seconds: float = 30.0
    heartbeat_seconds: float = 5.0  # NodeHeartbeat on polar.nodes.heartbeat and in polar:nodes
    docker_host: str | None = None  # the Docker API of the docker runtime; None: $DOCKER_HOST
