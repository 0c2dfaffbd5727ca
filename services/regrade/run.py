"""``polar regrade``'s I/O: stored trajectories read back, evaluated again from their
recorded artifacts, and stored re-graded on ``polar.regrades.<regrade_id>.<task>``.

An evaluator that needs no runtime (``needs_runtime = "none"``) runs here, on the
trajectory and the artifacts the builder stored beside it (diff, files, stdout). One that
needs a runtime cannot be given the session's (it is gone): those sessions are returned
for a replay (``polar replay`` with the new evaluator: the harness runs again from the
record into a fresh runtime, where the evaluator runs), whose verdict ``store`` keeps the
same way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from nats.js.errors import ObjectNotFoundError

from evaluators import (
    EvalContext,
    EvalResult,
    EvaluatorError,
    EvaluatorRegistry,
    create_evaluator,
    default_registry,
    run_evaluator,
)
from schemas import Artifacts, ContractError, EvaluatorSpec, TaskRequest, Trajectory, decode, encode
from schemas import subjects as S
from services.common.bus import Bus
from services.evaluator.logic import runtime_kind
from services.export.reader import read_stored
from services.regrade import logic
from services.regrade.logic import NewGrade, RegradeStats, Selection

TaskSpecs = Callable[[str], Awaitable[TaskRequest | None]]  # task id -> its stored spec


class RegradeError(RuntimeError):
    """The re-grade cannot start (its evaluator cannot be created): nothing was stored."""


async def store(bus: Bus, t: Trajectory, original: EvaluatorSpec, new: NewGrade) -> Trajectory:
    """``t`` re-graded by ``new``, stored once (deduplicated per re-grade and session)."""
    scored = logic.regraded(t, original, new)
    rid = logic.regrade_id(new.spec)
    await bus.send(S.regrades(rid, t.task_id), encode(scored), msg_id=logic.msg_id(rid, t))
    return scored


async def artifacts(bus: Bus, t: Trajectory) -> Artifacts | None:
    """The run's artifacts as the builder stored them; None when they are gone."""
    store_ = await bus.blobs()
    try:
        raw = (await store_.get(S.artifacts_object(t.session_id, t.attempt))).data
    except ObjectNotFoundError:
        return None
    try:
        return decode(raw, Artifacts)
    except ContractError:
        return None


async def evaluate(
    bus: Bus, evaluator, spec: EvaluatorSpec, t: Trajectory, task: TaskRequest
) -> EvalResult:
    art = await artifacts(bus, t)
    if art is None:
        name = S.artifacts_object(t.session_id, t.attempt)
        return EvalResult.error(f"the run's artifacts ({name}) are no longer stored")
    ctx = EvalContext(trajectory=t, artifacts=art, task=task, config=dict(spec.config))
    return await run_evaluator(evaluator, ctx, spec.timeout_seconds, spec.name)


async def regrade(
    bus: Bus,
    task_specs: TaskSpecs,
    selection: Selection,
    spec: EvaluatorSpec,
    *,
    evaluators: EvaluatorRegistry | None = None,
    concurrency: int = 16,
) -> tuple[RegradeStats, list[tuple[Trajectory, TaskRequest]]]:
    """Re-grade every stored trajectory ``selection`` takes with ``spec``: (what was
    done, the (trajectory, task) pairs left for a replay, when the evaluator needs a
    runtime). Raises RegradeError when the evaluator cannot be created."""
    try:
        evaluator = create_evaluator(evaluators or default_registry(), spec.name)
    except EvaluatorError as exc:
        raise RegradeError(str(exc)) from None
    needs_runtime = runtime_kind(evaluator.needs_runtime, spec.runtime) is not None
    stats = RegradeStats(logic.regrade_id(spec))
    for_replay: list[tuple[Trajectory, TaskRequest]] = []
    specs: dict[str, TaskRequest | None] = {}
    slots = asyncio.Semaphore(concurrency)
    started = time.perf_counter()

    async def one(t: Trajectory, task: TaskRequest) -> None:
        async with slots:
            result = await evaluate(bus, evaluator, spec, t, task)
            scored = await store(bus, t, task.evaluator, NewGrade(spec, result, "artifacts"))
        stats.count(t, scored, result)

    pending: set[asyncio.Task] = set()
    async for t, stored in read_stored(bus, S.STREAM_TRAJECTORIES, _subject(selection)):
        if not selection.takes(t, stored):
            continue
        stats.read += 1
        if t.task_id not in specs:
            specs[t.task_id] = await task_specs(t.task_id)
        task = specs[t.task_id]
        if task is None:
            stats.errors.append(f"{t.session_id}: task {t.task_id} is no longer in the registry")
        elif needs_runtime:
            for_replay.append((t, task))
        else:
            pending.add(asyncio.create_task(one(t, task)))
            if len(pending) >= 4 * concurrency:  # bounded: a large store is not read at once
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    if pending:
        await asyncio.gather(*pending)
    stats.seconds = time.perf_counter() - started
    return stats, for_replay


def _subject(selection: Selection) -> str:
    """One task's subject when the selection names exactly one task and no sessions."""
    if len(selection.task_ids) == 1 and not selection.session_ids:
        [task_id] = selection.task_ids
        return S.trajectories(task_id)
    return S.ALL_TRAJECTORIES
