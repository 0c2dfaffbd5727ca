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
    v: int = 1  # the event's shape version
    ts: float = 0.0  # epoch seconds: when it was published


class TaskAccepted(_Event, tag="task.accepted"):
    task_id: str  # the task
    session_ids: list[str]  # one per sample, in order


class TaskRejected(_Event, tag="task.rejected"):
    reason: str  # why, for the submitter
    payload: str  # the original message, as received (utf-8, replacement chars if binary)
    task_id: str | None = None  # the task's id, when the message named one
    field: str | None = None  # JSON path of the offending field, when one is to blame


class CancelTask(_Event, tag="task.cancel"):
    task_id: str  # the task whose live sessions end
    reason: str = "cancelled by user"  # the cancelled sessions' reason


class SessionStateChanged(_Event, tag="session.state"):
    session_id: str  # the session
    task_id: str  # its task
    from_state: SessionState | None  # None: the session's first state
    to_state: SessionState  # the state it entered
    version: int  # the session's version after it (Session.version)
    seq: int = 0  # global order of transitions as Redis applied them
    node: str | None = None  # the node holding it, once placed
    reason: str | None = None  # why, when there is one to say (an error, a cancel, the deadline)


class InitWork(_Event, tag="session.init"):
    """One per session: a runtime pool prepares its sandbox."""

    session_id: str  # the session
    task_id: str  # its task
    priority: int = 0  # higher first (TaskRequest.priority)
    attempt: int = 0  # the attempt to prepare


class ReadyWork(_Event, tag="session.ready"):
    """A prepared runtime handed to the executor on ``node``."""

    session_id: str  # the session
    task_id: str  # its task
    node: str  # the node whose executor runs it
    runtime_id: str  # the prepared runtime on that node
    priority: int = 0  # higher first
    attempt: int = 0  # the attempt it runs


class Artifacts(Struct, frozen=True, kw_only=True, omit_defaults=True):
    exit_code: int | None = None  # the harness's exit code; None: it did not exit by itself
    stdout_tail: str = ""  # the end of its stdout (the executor's tail_bytes)
    stderr_tail: str = ""  # the end of its stderr
    diff: str = ""  # git diff of the work dir against its prepared state
    logs: dict[str, str] = {}  # harness log files, by name
    files: dict[str, str] = {}  # named output files
    harness: str | None = None  # the harness that ran
    harness_version: str | None = None  # its version, when known
    protocol: str | None = None  # the model API it spoke


class SessionFinished(_Event, tag="session.finished"):
    session_id: str  # the session
    task_id: str  # its task
    outcome: Outcome  # how the harness run ended
    attempt: int = 0  # the attempt that ran
    reason: str | None = None  # why it ended as it did (harness, deadline, cancel)
    artifacts: Artifacts = field(default_factory=Artifacts)  # what the run left
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

    session_id: str  # the session
    task_id: str  # its task
    outcome: Outcome  # how the harness run ended
    attempt: int = 0  # the attempt built
    artifacts: Artifacts = field(default_factory=Artifacts)  # the SessionFinished's
    eval_runtime_id: str | None = None  # a runtime left for the evaluation
    node: str | None = None  # the node that holds it
    # the unscored trajectory; None: read it from the object store
    trajectory: Trajectory | None = None

    @property
    def subject(self) -> str:
        if self.eval_runtime_id and self.node:
            return S.sessions_built_on(self.node)
        return S.SESSIONS_BUILT_ANY


class SessionScored(_Event, tag="session.scored"):
    session_id: str  # the session
    task_id: str  # its task
    outcome: Outcome  # how the harness run ended
    reward: float | None  # None: the evaluation failed
    attempt: int = 0  # the attempt scored
    eval_status: str = "ok"  # ok | error
    reason: str | None = None  # the evaluator's reason, or why it failed


class NodeHeartbeat(_Event, tag="node.heartbeat"):
    node: str  # the node
    service: str  # the service reporting (pool, executor)
    stages: dict[str, int] = {}  # e.g. {"INIT": 3, "READY": 8, "RUNNING": 16}
    capacity: dict[str, int] = {}  # each stage's bound


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
