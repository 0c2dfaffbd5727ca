"""``polar replay SESSION``: re-run a recorded session with its calls answered from the
record (proxy/replay.py), then say how the replay went.

The session's task is submitted again as one session (same harness, runtime, prepare
steps, instruction, evaluator), with ``replay`` naming the recorded attempt, no retries
(a retry would renumber the calls) and ``metadata.replay_of`` for its lineage. With
``--until K`` it is a fork: K recorded answers, then the engine. What is printed comes
from the replay's own records: how many calls were replayed, which of them differed only
where a harness differs from run to run (and where), the divergence (call and field) if
it diverged, the live calls of a fork, and the outcome and reward beside the recorded
session's.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import msgspec

from schemas import CompletionRecord, ReplaySpec, Session, TaskRequest, encode
from schemas.completion import REPLAY_DIVERGED, REPLAY_FAILED, REPLAYED
from services.cli import taskfile

EXIT_DIVERGED = 4  # polar replay's exit code when the replay diverged


def replay_task(
    spec: TaskRequest, recorded: Session, until: int | None, train: bool
) -> TaskRequest:
    """The recorded session's task, to replay that session once."""
    replay = ReplaySpec(
        session_id=recorded.session_id,
        attempt=recorded.attempt,
        seq_floor=recorded.seq_floor,
        until=until,
        train=train,
    )
    return msgspec.structs.replace(
        spec,
        task_id=f"replay-{uuid.uuid4().hex[:12]}",
        num_samples=1,
        early_stop=None,
        max_retries=0,  # a retry renumbers the calls: the replay would diverge
        infra_retries=0,
        callback_url=None,
        replay=replay,
        metadata={**spec.metadata, "replay_of": recorded.session_id},
    )


def task_file(task: TaskRequest) -> taskfile.TaskFile:
    return taskfile.TaskFile(payload=encode(task), task_id=task.task_id, num_samples=1)


@dataclass
class ReplayReport:
    replayed: int = 0  # calls answered from the record
    live: int = 0  # a fork's calls the engine answered
    # (call, what explained its difference) for calls that differed only by nondeterminism
    nondeterministic: list[tuple[int, list[str]]] = field(default_factory=list)
    diverged: str | None = None  # the first divergence's report
    failures: list[str] = field(default_factory=list)  # recorded failures replayed

    def lines(self) -> list[str]:
        out = [f"replayed {self.replayed} call(s) from the record"]
        if self.live:
            out.append(f"then {self.live} live call(s) from the engine")
        for call, names in self.nondeterministic:
            out.append(f"call {call}: differed only by {', '.join(names)} (nondeterministic)")
        out += [f"replayed failure: {f}" for f in self.failures]
        if self.diverged:
            out.append(f"diverged: {self.diverged}")
        return out


def replay_report(records: list[CompletionRecord]) -> ReplayReport:
    """What the replay's own records say of it (plain: tested without a stack)."""
    report = ReplayReport()
    first = min((r.seq for r in records), default=0)
    for rec in sorted(records, key=lambda r: r.seq):
        mark = rec.replay
        if mark is None:
            report.live += not rec.void
        elif mark.result == REPLAYED:
            report.replayed += 1
            if mark.nondeterministic:
                report.nondeterministic.append((rec.seq - first, list(mark.nondeterministic)))
        elif mark.result == REPLAY_DIVERGED:
            report.diverged = report.diverged or rec.error
        elif mark.result == REPLAY_FAILED:
            report.failures.append(rec.error or "")
    return report
