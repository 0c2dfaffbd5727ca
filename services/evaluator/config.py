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
    proxy_url: str = "http://127.0.0.1:8200"  # the proxy as the runtimes reach it
    docker_host: str | None = None  # the Docker API of the docker runtime; None: $DOCKER_HOST
    # a runtime's processes get this long to stop before they are killed
    stop_grace_seconds: float = 2.0
    result_ttl_seconds: float = 7 * 24 * 3600.0  # a kept evaluation result expires then
    # The nodes whose runtimes this evaluator reaches (their work_dir and docker_host are
    # the ones above): it takes their sessions that are evaluated in a runtime left on
    # the node. Empty: its own ``node``. `polar up` lists every node (one machine).
    nodes: tuple[str, ...] = ()
    # Another node's queue holding work nobody has taken for ``orphan_after_seconds`` (its
    # host is gone) is drained here, in fresh runtimes; looked at every ``..._check_...``.
    orphan_check_seconds: float = 10.0
    orphan_after_seconds: float = 60.0  # see orphan_check_seconds

    @property
    def reachable_nodes(self) -> tuple[str, ...]:
        return self.nodes or (self.node,)
