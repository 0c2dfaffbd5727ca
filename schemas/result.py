"""TaskResult: the end of a task, on ``polar.tasks.<task_id>.result`` and the callback."""

from __future__ import annotations

from msgspec import Struct

from schemas.session import SessionState


class SessionResult(Struct, frozen=True, kw_only=True, omit_defaults=True):
    session_id: str  # the session
    state: SessionState  # its final state
    reward: float | None = None  # its reward; None: none (failed before, or in, the evaluation)
    reason: str | None = None  # why its run ended as it did
    eval_reason: str | None = None  # the evaluator's reason for the reward
    early_stopped: bool = False  # ended by the task's early stop, not by its own run


class TaskResult(Struct, frozen=True, kw_only=True, omit_defaults=True):
    v: int = 1  # the shape's version
    task_id: str  # the task
    status: str  # completed | failed (no session COMPLETED) | cancelled | early_stopped
    num_samples: int  # sessions the task ran
    sessions: list[SessionResult]  # each session's end, in order
    counts: dict[str, int] = {}  # final state -> sessions
    mean_reward: float | None = None  # over the sessions with a reward; None: none has one
    submitted_at: float = 0.0  # epoch seconds
    finished_at: float = 0.0  # epoch seconds
    # where its trajectories are delivered: polar.trajectories.<task_id>
    trajectories_subject: str = ""
