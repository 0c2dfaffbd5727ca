"""Sessions and their state machine.

    REGISTERED -> INITIALIZING -> READY -> RUNNING -> POSTRUN -> BUILDING -> EVALUATING
        -> COMPLETED | TIMEOUT | ERROR        (and CANCELLED from any live state)

The final state of an evaluated session says how its harness ended (``Outcome``); every
outcome is built and evaluated, so nothing captured is ever lost.
"""

from __future__ import annotations

import enum

from msgspec import Struct


class SessionState(enum.StrEnum):
    REGISTERED = "REGISTERED"
    INITIALIZING = "INITIALIZING"
    READY = "READY"
    RUNNING = "RUNNING"
    POSTRUN = "POSTRUN"
    BUILDING = "BUILDING"
    EVALUATING = "EVALUATING"
    COMPLETED = "COMPLETED"
    TIMEOUT = "TIMEOUT"
    ERROR = "ERROR"
    CANCELLED = "CANCELLED"


S = SessionState
TERMINAL_STATES = frozenset({S.COMPLETED, S.TIMEOUT, S.ERROR, S.CANCELLED})
LIVE_STATES = frozenset(set(S) - TERMINAL_STATES)

# to-state -> the states it may be entered from. The registry's CAS script enforces it.
ALLOWED_FROM: dict[SessionState, frozenset[SessionState]] = {
    S.REGISTERED: frozenset({S.INITIALIZING, S.READY, S.RUNNING}),  # retry of an attempt
    S.INITIALIZING: frozenset({S.REGISTERED}),
    S.READY: frozenset({S.INITIALIZING}),
    S.RUNNING: frozenset({S.READY}),
    # from before RUNNING: a session that failed before it ran, finished with nothing
    # captured so it still yields its (empty, ERROR) trajectory
    S.POSTRUN: frozenset({S.RUNNING, S.REGISTERED, S.INITIALIZING, S.READY}),
    S.BUILDING: frozenset({S.POSTRUN}),
    S.EVALUATING: frozenset({S.BUILDING}),
    S.COMPLETED: frozenset({S.EVALUATING}),
    S.TIMEOUT: frozenset({S.EVALUATING}),
    S.ERROR: LIVE_STATES,
    S.CANCELLED: LIVE_STATES,
}


class Outcome(enum.StrEnum):
    """How the harness run ended; becomes the session's final state after evaluation."""

    COMPLETED = "completed"
    TIMEOUT = "timeout"
    ERROR = "error"
    CANCELLED = "cancelled"

    @property
    def final_state(self) -> SessionState:
        return SessionState(self.value.upper())


class Session(Struct, frozen=True, kw_only=True):
    session_id: str  # "<task_id>-<index:04d>"
    task_id: str  # its task
    index: int  # its sample's number in the task, from 0
    token: str  # unguessable; the harness's API key and URL secret
    state: SessionState = S.REGISTERED  # where it is in its lifecycle
    version: int = 0  # bumped by every transition
    attempt: int = 0  # 0, then one more each time a fault of the system retries it
    # the call counter when this attempt began: lower call numbers are earlier attempts'
    # (one an attempt cut off mid-call never recorded is its gap, not this attempt's)
    seq_floor: int = 0
    priority: int = 0  # higher first (the task's)
    node: str | None = None  # the node it is placed on; None before
    created_at: float = 0.0  # epoch seconds
    updated_at: float = 0.0  # time of the last transition
    deadline: float = 0.0  # epoch seconds: the whole session must end by then
    outcome: Outcome | None = None  # how its harness run ended, once it has
    reward: float | None = None  # once evaluated; None: not yet, or the evaluation failed
    reason: str | None = None  # why the run ended as it did (harness, deadline, cancel)
    eval_status: str | None = None  # ok | error, once evaluated
    eval_reason: str | None = None  # why this reward, in the evaluator's words


def session_id_for(task_id: str, index: int) -> str:
    """Deterministic, so a task published twice maps onto the same sessions."""
    return f"{task_id}-{index:04d}"
