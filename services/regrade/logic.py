"""What a re-grade decides, without servers: which stored trajectories it takes, how it
names itself, and the re-graded trajectory (the same tokens, the new reward, both
grades)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime

import msgspec
import orjson

from evaluators import EvalResult
from schemas import EvaluatorSpec, Grade, Trajectory
from services.evaluator.logic import score


@dataclass(frozen=True)
class Selection:
    """Which stored sessions a re-grade takes: sessions or tasks named (all when both
    are empty), stored within [since, until)."""

    session_ids: frozenset[str] = frozenset()
    task_ids: frozenset[str] = frozenset()
    since: datetime | None = None
    until: datetime | None = None

    def takes(self, t: Trajectory, stored: datetime | None = None) -> bool:
        if is_replay(t):  # a replay is graded with its original, not on its own
            return False
        named = self.session_ids or self.task_ids
        if named and t.session_id not in self.session_ids and t.task_id not in self.task_ids:
            return False
        if stored is not None and self.until is not None and stored >= self.until:
            return False
        return not (stored is not None and self.since is not None and stored < self.since)


def is_replay(t: Trajectory) -> bool:
    return "replay_of" in t.metadata


def config_digest(config: dict[str, object]) -> str:
    return hashlib.sha256(orjson.dumps(config, option=orjson.OPT_SORT_KEYS)).hexdigest()[:12]


def regrade_id(spec: EvaluatorSpec) -> str:
    """One name per evaluator and config: re-grading again with the same one is the same
    re-grade (its trajectories deduplicated on the stream), another config another one."""
    name = "".join(c if c.isalnum() else "-" for c in spec.name).strip("-").lower()
    return f"{name[:40]}-{config_digest(dict(spec.config))}"


def session_grade(t: Trajectory, spec: EvaluatorSpec) -> Grade:
    """The session's own grade, as its evaluation delivered it."""
    return Grade(
        evaluator=spec.name,
        config_digest=config_digest(dict(spec.config)),
        reward=t.reward,
        status=t.eval_status,
        reason=t.eval_reason,
    )


@dataclass(frozen=True)
class NewGrade:
    spec: EvaluatorSpec
    result: EvalResult
    via: str  # artifacts | replay
    replay_session: str | None = None


def regraded(t: Trajectory, original: EvaluatorSpec, new: NewGrade) -> Trajectory:
    """``t`` (a delivered trajectory) scored by ``new``: its tokens as stored, reward and
    status the new evaluation's, ``grades`` the session's own then the new one."""
    meta = t.metadata
    num_samples = meta.get("num_samples")
    index = meta.get("sample_index")
    rescored = score(
        t,
        new.result,
        num_samples=num_samples if isinstance(num_samples, int) else 1,
        index=index if isinstance(index, int) else 0,
    )
    rid = regrade_id(new.spec)
    grade = Grade(
        evaluator=new.spec.name,
        config_digest=config_digest(dict(new.spec.config)),
        reward=rescored.reward,
        status=new.result.status,
        reason=rescored.eval_reason,
        regrade_id=rid,
        via=new.via,
        replay_session=new.replay_session,
    )
    first = t.grades[:1] or [session_grade(t, original)]
    metadata = {**rescored.metadata, "regrade_id": rid}
    return msgspec.structs.replace(rescored, grades=[*first, grade], metadata=metadata)


def msg_id(regrade: str, t: Trajectory) -> str:
    """A re-grade's trajectory is stored once per re-grade, session and attempt."""
    return f"regrade:{regrade}:{t.session_id}:{t.attempt}"


@dataclass
class RegradeStats:
    regrade_id: str
    read: int = 0  # trajectories read from the stream
    graded: int = 0  # re-graded and stored
    changed: int = 0  # whose reward differs from the session's own
    errors: list[str] = field(default_factory=list)  # sessions whose evaluation failed
    seconds: float = 0.0

    def rate(self) -> float:
        return self.graded / self.seconds if self.seconds > 0 else 0.0

    def count(self, t: Trajectory, scored: Trajectory, result: EvalResult) -> None:
        """``t`` was re-graded as ``scored`` by ``result``."""
        self.graded += 1
        if result.status != "ok":
            self.errors.append(f"{t.session_id}: {result.reason}")
        if scored.reward != t.reward:
            self.changed += 1
