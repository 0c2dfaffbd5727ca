"""TaskResult: the end of a task, on ``polar.tasks.<task_id>.result`` and the callback."""

from __future__ import annotations

from msgspec import Struct

from schemas.session import SessionState


class SessionResult(Struct, frozen=True, kw_only=True, omit_defaults=True):
    session_id: str
    state: SessionState
    reward: float | None = None
    reason: str | None = None
    eval_reason: str | None = None  # the evaluator's reason for the reward
    early_stopped: bool = False


class TaskResult(Struct, frozen=True, kw_only=True, omit_defaults=True):
    v: int = 1
    task_id: str
    status: str  # completed | failed (no session COMPLETED) | cancelled | early_stopped
    num_samples: int
    sessions: list[SessionResult]
    counts: dict[str, int] = {}  # final state -> sessions
    mean_reward: float | None = None
    submitted_at: float = 0.0
    finished_at: float = 0.0
    trajectories_subject: str = ""
