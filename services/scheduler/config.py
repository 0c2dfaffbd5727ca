from __future__ import annotations

from schemas.task import MAX_TASK_BYTES
from services.common.settings import ServiceSettings


class SchedulerConfig(ServiceSettings, frozen=True, kw_only=True):
    port: int = 8100
    # a task message or body over this is refused (413 over HTTP)
    max_task_bytes: int = MAX_TASK_BYTES
    callback_attempts: int = 5  # POSTs of a TaskResult to its callback_url before giving up
    callback_timeout_seconds: float = 10.0  # each POST's time limit
    callback_backoff_seconds: float = 0.5  # the wait before the second POST, doubled after each
    # how often tasks whose last event was missed are finished, and sessions past their deadline
    # ended
    reconcile_interval_seconds: float = 5.0
    # A task message without task_id or Nats-Msg-Id published again with the same bytes
    # within this many seconds joins the first copy's task; 0 turns that off.
    submit_dedupe_seconds: float = 120.0
    # HTTP API credentials (services/common/auth.py): the admin token submits and
    # cancels (a task runs commands on the nodes), the read token (or the admin one)
    # reads tasks and sessions. A role without a token is closed. `polar up` sets both.
    admin_token: str | None = None
    read_token: str | None = None  # the read token (above)
