from __future__ import annotations

from typing import Any

from services.common.settings import ServiceSettings


class DashboardConfig(ServiceSettings, frozen=True, kw_only=True):
    port: int = 8160
    # Cancel (the dashboard's one action) needs this as a bearer token; None: closed.
    # `polar up` hands it the stack's admin token (infra/wiring.py).
    admin_token: str | None = None
    # Every page and /api route needs this (or the admin token) as a bearer token, or the
    # cookie a sign-in link gives; None and no admin_token: closed. `polar up` sets it.
    read_token: str | None = None
    state_dir: str | None = None  # the stack's record (stack.json): the topology page
    model_dir: str | None = None  # the tokenizer that decodes token ids; ids shown without
    trainer_log: str | None = None  # the trainer's JSONL log: the training page
    backends: list[dict[str, Any]] = []  # engines whose queue the overview shows
    refresh_seconds: float = 0.5  # how often changed sessions are re-read and pushed
    stack_poll_seconds: float = 2.0  # nodes, streams, engines, backpressure
    artifact_sessions: int = 2000  # finished sessions' artifacts kept in memory
    trajectory_cache: int = 256  # built trajectories kept in memory
