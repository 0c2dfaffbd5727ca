"""The scheduler's decisions, as plain functions (no network, no clock)."""

from __future__ import annotations

import hashlib
import importlib.util
import math
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import orjson

from schemas import (
    TERMINAL_STATES,
    ContractError,
    InitWork,
    Session,
    SessionResult,
    SessionState,
    TaskRequest,
    TaskResult,
    decode,
    decode_strict,
)
from schemas import subjects as S
from schemas.task import BUILTIN_BUILDERS, BUILTIN_EVALUATORS, BUILTIN_HARNESSES

_CUSTOM = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_MSG_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class Rejection:
    reason: str
    field: str | None = None
    task_id: str | None = None


def parse_submission(raw: bytes, *, max_bytes: int, strict: bool = True) -> TaskRequest | Rejection:
    """A submitted task, or why it is refused. A person's task is checked strictly on
    every path (bus and HTTP): an unknown key (``builder.strategy``, ``evaluator.nmae``)
    is a rejection naming it, never a silently ignored setting. ``strict=False`` is the
    tolerant decode of events between services, not for submissions."""
    if len(raw) > max_bytes:
        return Rejection(f"task message is {len(raw)} bytes; the limit is {max_bytes}")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return Rejection(f"not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return Rejection(f"a task must be a JSON object, got {type(obj).__name__}")
    task_id = _task_id_in(obj)
    try:
        task = (decode_strict if strict else decode)(raw, TaskRequest)
    except ContractError as exc:
        return Rejection(exc.reason, exc.field, task_id)
    problem = check_plugins(task)
    if problem:
        return Rejection(problem[1], problem[0], task_id)
    return task


def _task_id_in(obj: object) -> str | None:
    task_id = obj.get("task_id") if isinstance(obj, dict) else None
    return task_id if isinstance(task_id, str) else None


def named_task_id(raw: bytes) -> str | None:
    """The task id a submitted message names, if any (for a rejection)."""
    try:
        return _task_id_in(orjson.loads(raw))
    except orjson.JSONDecodeError:
        return None


@dataclass(frozen=True)
class PluginRef:
    """A plugin a task names: where (the field), what kind, and its name."""

    field: str
    kind: str
    name: str

    @property
    def custom(self) -> bool:
        return ":" in self.name


BUILTIN = {
    "harness": BUILTIN_HARNESSES,
    "builder": BUILTIN_BUILDERS,
    "evaluator": BUILTIN_EVALUATORS,
}


def plugin_refs(task: TaskRequest) -> list[PluginRef]:
    """Every plugin the task names: its harness, builder and evaluator, and the base
    evaluator a ``rubric`` mixes its score into (``evaluator.config.base.name``)."""
    refs = [
        PluginRef("$.agent.harness", "harness", task.agent.harness),
        PluginRef("$.builder.name", "builder", task.builder.name),
        PluginRef("$.evaluator.name", "evaluator", task.evaluator.name),
    ]
    base = task.evaluator.config.get("base") if task.evaluator.name == "rubric" else None
    if isinstance(base, dict) and isinstance(base.get("name"), str):
        refs.append(PluginRef("$.evaluator.config.base.name", "evaluator", base["name"]))
    return refs


def _plugin_problem(ref: PluginRef) -> str | None:
    """Why nobody has the plugin ``ref`` names, from its name alone (a custom one that
    can be found is checked further by ``services/scheduler/plugincheck.py``)."""
    kind, name, builtin = ref.kind, ref.name, BUILTIN[ref.kind]
    if name in builtin:
        return None
    if not _CUSTOM.match(name):
        known = ", ".join(sorted(builtin))
        return f"unknown {kind} {name!r}: use one of {known}, or 'module:Class'"
    module = name.split(":", 1)[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return f"custom {kind} {name!r}: module {module!r} is not importable"
    return None


def check_plugins(task: TaskRequest) -> tuple[str, str] | None:
    """(field, reason) when the task names a harness, builder or evaluator nobody has."""
    for ref in plugin_refs(task):
        reason = _plugin_problem(ref)
        if reason:
            return ref.field, reason
    return None


def usable_msg_id(msg_id: str | None) -> bool:
    return bool(msg_id and _MSG_ID.fullmatch(msg_id))


def with_task_id(
    task: TaskRequest, msg_id: str | None = None, fresh: str | None = None
) -> TaskRequest:
    """Give an anonymous task an id: its Nats-Msg-Id when usable (so a republished
    message dedupes), otherwise ``fresh`` or a random one."""
    if task.task_id:
        return task
    import msgspec

    if usable_msg_id(msg_id):
        return msgspec.structs.replace(task, task_id=msg_id)
    return msgspec.structs.replace(task, task_id=fresh or "t-" + uuid.uuid4().hex[:16])


def needs_payload_dedupe(task: TaskRequest, msg_id: str | None) -> bool:
    """Nothing names this task: only its bytes can tell a second copy from a new task."""
    return not task.task_id and not usable_msg_id(msg_id)


def payload_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def message_task_id(digest: str, stream_seq: int, published_at: float) -> str:
    """The task id of one stored message: the same on every redelivery of it (a crash
    between registering and acking must not make a second task), another for any
    other message, even one with the same bytes."""
    h = hashlib.sha256(f"{digest}:{stream_seq}:{published_at!r}".encode()).hexdigest()
    return "t-" + h[:16]


@dataclass(frozen=True)
class FirstCopy:
    """The first anonymous message with some bytes: the task it made and when it was
    published (stored in Redis as "<task id> <published at>")."""

    task_id: str
    published_at: float

    def encode(self) -> bytes:
        return f"{self.task_id} {self.published_at!r}".encode()

    @classmethod
    def parse(cls, raw: bytes | None) -> FirstCopy | None:
        try:
            task_id, ts = (raw or b"").decode().split(" ")
            return cls(task_id, float(ts))
        except ValueError:  # absent or unreadable: as if no copy came first
            return None


def join_first(first: FirstCopy | None, own: FirstCopy, window: float) -> FirstCopy:
    """The copy whose task a message joins: the first one when the two were published
    within ``window`` seconds of each other, else the message itself (a new task)."""
    if first is not None and abs(own.published_at - first.published_at) <= window:
        return first
    return own


def dedupe_ttl(window: float) -> int:
    """Seconds to keep the first copy's record: twice the window, so a copy published
    within the window but handled later (a backlog, a restart) still finds it."""
    return max(1, math.ceil(2 * window))


# Sessions nobody holds while they wait: the scheduler ends them once their deadline passed.
WAITING = (SessionState.REGISTERED, SessionState.READY)
DEADLINE_SLACK_S = 1.0  # the task's submission time and its sessions' deadlines: one clock


def may_have_overdue(
    submitted_at: float, spec: TaskRequest, counts: dict[str, int], now: float
) -> bool:
    """Whether any session of the task may be waiting past its deadline (each session's
    deadline is the task's submission time plus ``timeout_seconds``)."""
    waiting = any(counts.get(st, 0) for st in WAITING)
    return waiting and submitted_at + spec.timeout_seconds - DEADLINE_SLACK_S < now


def is_finished(counts: dict[str, int], num_samples: int) -> bool:
    return sum(counts.get(s, 0) for s in TERMINAL_STATES) >= num_samples


def should_early_stop(counts: dict[str, int], early_stop: int | None) -> bool:
    return early_stop is not None and counts.get(SessionState.COMPLETED, 0) >= early_stop


def build_result(
    task: TaskRequest,
    sessions: Iterable[Session],
    *,
    submitted_at: float,
    now: float,
) -> TaskResult:
    rows = [
        SessionResult(
            session_id=s.session_id,
            state=s.state,
            reward=s.reward,
            reason=s.reason,
            eval_reason=s.eval_reason,
            early_stopped=s.state == SessionState.CANCELLED
            and (s.reason or "").startswith("early stop"),
        )
        for s in sorted(sessions, key=lambda s: s.index)
    ]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    rewards = [r.reward for r in rows if r.reward is not None]
    if any(r.early_stopped for r in rows):
        status = "early_stopped"
    elif counts.get(SessionState.CANCELLED, 0) == len(rows):
        status = "cancelled"
    elif not counts.get(SessionState.COMPLETED, 0):
        status = "failed"  # no session ran to its end (every one ERROR, TIMEOUT or cancelled)
    else:
        status = "completed"
    return TaskResult(
        task_id=task.task_id or "",
        status=status,
        num_samples=task.num_samples,
        sessions=rows,
        counts=counts,
        mean_reward=sum(rewards) / len(rewards) if rewards else None,
        submitted_at=submitted_at,
        finished_at=now,
        trajectories_subject=S.trajectories(task.task_id or ""),
    )


def init_msg_id(session: Session) -> str:
    return f"init:{session.session_id}:{session.attempt}"


def init_work(session: Session, now: float) -> InitWork:
    return InitWork(
        ts=now,
        session_id=session.session_id,
        task_id=session.task_id,
        priority=session.priority,
        attempt=session.attempt,
    )
