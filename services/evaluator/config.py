from __future__ import annotations

from services.common.settings import ServiceSettings


class EvaluatorConfig(ServiceSettings, frozen=True, kw_only=True):
    port: int = 8140
    concurrency: int = 8  # sessions evaluated at once
    ack_wait_seconds: float = 30.0  # a crashed evaluation is redelivered after this
    max_deliver: int = 10  # then dead-lettered with the reason
    retry_delay_seconds: float = 0.25  # a session that changed while being advanced
    # Runtimes: the same node directories and proxy as this node's pool and executor.
    work_dir: str = ".state/work"
    proxy_url: str = "http://127.0.0.1:8200"
    docker_host: str | None = None
    stop_grace_seconds: float = 2.0
    result_ttl_seconds: float = 7 * 24 * 3600.0  # a kept evaluation result expires then
