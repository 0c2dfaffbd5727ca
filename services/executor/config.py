from __future__ import annotations

from services.node.settings import NodeSettings


class ExecutorConfig(NodeSettings, frozen=True, kw_only=True):
    port: int = 8120
    # a harness past its deadline or cancelled: SIGTERM, then SIGKILL after this
    kill_grace_seconds: float = 2.0
    tail_bytes: int = 16 * 1024  # stdout/stderr tails kept in the session-finished event
    max_log_bytes: int = 256 * 1024  # per collected harness log file
    max_diff_bytes: int = 2 * 1024 * 1024  # the work dir's git diff kept in the artifacts, at most
