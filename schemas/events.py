"""Events on the bus: one tagged union, each event versioned (``v``) and stamped (``ts``).

Decode with ``schemas.codec.decode_event``; unknown fields are tolerated on the bus so a
newer producer never breaks an older consumer.
"""

from __future__ import annotations

from msgspec import Struct, field

from schemas import subjects as S
from schemas.session import Outcome, SessionState
from schemas.trajectory import Trajectory


class _Event(Struct, frozen=True, kw_only=True, tag_field="type", omit_defaults=True):
    v: int = 1
    ts: float = 0.0


class TaskAccepted(_Event, tag="task.accepted"):
    task_id: str
    session_ids: list[str]


class TaskRejected(_Event, tag="task.rejected"):
    reason: str
    payload: str  # the original message, as received (utf-8, replacement chars if binary)
    task_id: str | None = None
    field: str | None = None  # JSON path of the offending field, when one is to blame


class CancelTask(_Event, tag="task.cancel"):
    task_id: str
    reason: str = "cancelled by user"


class SessionStateChanged(_Event, tag="session.state"):
    session_id: str
    task_id: str
    from_state: SessionState | None
    to_state: SessionState
    version: int
    seq: int = 0  # global order of transitions as Redis applied them
    node: str | None = None
    reason: str | None = None


class InitWork(_Event, tag="session.init"):
    """One per session: a runtime pool prepares its sandbox."""

    session_id: str
    task_id: str
    priority: int = 0
    attempt: int = 0


class ReadyWork(_Event, tag="session.ready"):
    """A prepared runtime handed to the executor on ``node``."""

    session_id: str
    task_id: str
    node: str
    runtime_id: str
    priority: int = 0
    attempt: int = 0


class Artifacts(Struct, frozen=True, kw_only=True, omit_defaults=True):
    exit_code: int | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    diff: str = ""
    logs: dict[str, str] = {}  # harness log files, by name
    files: dict[str, str] = {}  # named output files
    harness: str | None = None
    harness_version: str | None = None
    protocol: str | None = None


class SessionFinished(_Event, tag="session.finished"):
    session_id: str
    task_id: str
    outcome: Outcome
    attempt: int = 0
    reason: str | None = None
    artifacts: Artifacts = field(default_factory=Artifacts)
    eval_runtime_id: str | None = None  # a runtime left for the evaluation (live or prewarmed)
    node: str | None = None  # where that runtime is: the node that ran the session
    seq_floor: int = 0  # the attempt's first call number (``Session.seq_floor``)


class TrajectoryBuilt(_Event, tag="session.built"):
    """The unscored Trajectory is in the object store as ``trajectories/<session>/<attempt>``
    (for readers such as the dashboard), and in ``trajectory`` too: the evaluator takes it
    from the event, and from the store only for an event without it. (A large event goes
    by claim-check like any payload, ``Bus.publish``.)

    ``artifacts``, ``eval_runtime_id`` and ``node`` are carried over from the
    SessionFinished (which the builder consumes from a work queue): the evaluator needs
    them. An event with a runtime left on a node goes to that node's evaluators
    (``subject``): only they reach the runtime."""

    session_id: str
    task_id: str
    outcome: Outcome
    attempt: int = 0
    artifacts: Artifacts = field(default_factory=Artifacts)
    eval_runtime_id: str | None = None
    node: str | None = None
    trajectory: Trajectory | None = None

    @property
    def subject(self) -> str:
        if self.eval_runtime_id and self.node:
            return S.sessions_built_on(self.node)
        return S.SESSIONS_BUILT_ANY


class SessionScored(_Event, tag="session.scored"):
    session_id: str
    task_id: str
    outcome: Outcome
    reward: float | None
    attempt: int = 0
    eval_status: str = "ok"  # ok | error
    reason: str | None = None


class NodeHeartbeat(_Event, tag="node.heartbeat"):
    node: str
    service: str
    stages: dict[str, int] = {}  # e.g. {"INIT": 3, "READY": 8, "RUNNING": 16}
    capacity: dict[str, int] = {}


Event = (
    TaskAccepted
    | TaskRejected
    | CancelTask
    | SessionStateChanged
    | InitWork
    | ReadyWork
    | SessionFinished
    | TrajectoryBuilt
    | SessionScored
    | NodeHeartbeat
)
