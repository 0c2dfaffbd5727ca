"""The evaluator's I/O shell: TrajectoryBuilt -> evaluate -> deliver -> finish.

Exactly once on ``polar.trajectories.<task>``, whatever crashes where:

1. the result is kept in Redis before anything is sent; a redelivery reuses it;
2. the scored trajectory is published with the dedupe id ``traj:<session>:<attempt>``
   (the trajectories stream's duplicate window is 3 h) and marked published;
3. EVALUATING -> final state is a CAS carrying the reward; a session found final is
   only finished off (SessionScored, runtime cleanup), never delivered again.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg
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
from schemas import (
    ContractError,
    Session,
    SessionState,
    TaskRequest,
    Trajectory,
    TrajectoryBuilt,
    decode,
    encode,
)
from schemas import subjects as S
from services.common import cancels
from services.common.bus import Bus
from services.common.consumer import Poison, Retry
from services.common.quarantine import Verdict
from services.common.registry import Registry
from services.evaluator import logic
from services.evaluator.config import EvaluatorConfig
from services.evaluator.logic import Action
from services.evaluator.records import EvalRecords
from services.evaluator.runtimes import EvalRuntimes
from services.evaluator.sidecalls import SessionSideCalls

log = logging.getLogger(__name__)


class EvaluatorService:
    def __init__(
        self,
        bus: Bus,
        registry: Registry,
        config: EvaluatorConfig,
        evaluators: EvaluatorRegistry | None = None,
    ) -> None:
        self.bus, self.registry, self.config = bus, registry, config
        self.evaluators = evaluators or default_registry()
        self.records = EvalRecords(registry.redis, config.result_ttl_seconds)
        self.runtimes = EvalRuntimes(config)
        # sessions evaluated at once, over every queue it takes (services.evaluator.main)
        self.slots = asyncio.Semaphore(config.concurrency)

    async def give_up(self, msg: Msg) -> str | None:
        """Asked before a session whose evaluation died with the process is evaluated
        again: not when its task was cancelled meanwhile (``cancels``)."""
        event = decode(await self.bus.payload(msg), TrajectoryBuilt)
        asked = await cancels.asked(self.registry.redis, event.session_id)
        if asked is None:
            return None
        return f"quarantined: cancelled ({asked}) after its evaluation died with the evaluator"

    async def on_quarantined(self, msg: Msg, verdict: Verdict) -> None:
        """Evaluating this session killed the service again and again: it is delivered
        with an error result saying so, its evaluator not run again."""
        await self.on_built(msg, quarantined=verdict)

    async def on_built(self, msg: Msg, *, quarantined: Verdict | None = None) -> None:
        try:
            event = decode(await self.bus.payload(msg), TrajectoryBuilt)
        except (ContractError, LookupError) as exc:
            raise Poison(f"not a TrajectoryBuilt: {exc}") from None
        session = await self.registry.get_session(event.session_id)
        decision = logic.decide(session, event)
        if decision.action is Action.ADVANCE:
            await self.registry.transition(
                event.session_id,
                SessionState.EVALUATING,
                from_=[SessionState.BUILDING],
                expect_attempt=event.attempt,
            )  # ours, or the builder's just before it: either way, decide again
            session = await self.registry.get_session(event.session_id)
            decision = logic.decide(session, event)
        if decision.action is Action.POISON:
            raise Poison(decision.reason)
        if decision.action is Action.ADVANCE:  # back to BUILDING meanwhile: look again later
            raise Retry(self.config.retry_delay_seconds, decision.reason)
        if decision.action is Action.SKIP:
            log.info("%s: skipped: %s", event.session_id, decision.reason)
            return
        task = await self.task_spec(event.task_id)
        if decision.action is Action.FINALIZE:
            await self.finalize(event, task)
            return
        await self.deliver(event, session, task, quarantined)

    async def task_spec(self, task_id: str) -> TaskRequest:
        spec = await self.registry.task_spec(task_id)
        if spec is None:
            raise Poison(f"task {task_id!r} is not in the registry: no evaluator spec")
        return spec

    async def load(self, event: TrajectoryBuilt) -> Trajectory:
        if event.trajectory is not None:  # carried by the event (the builder's own)
            return event.trajectory
        store = await self.bus.blobs()
        name = S.trajectory_object(event.session_id, event.attempt)
        try:
            raw = (await store.get(name)).data
        except ObjectNotFoundError:
            raise Poison(f"the built trajectory {name!r} is not in the object store") from None
        try:
            return decode(raw, Trajectory)
        except ContractError as exc:
            raise Poison(f"the built trajectory {name!r} is not a Trajectory: {exc}") from None

    # -- the one delivery -------------------------------------------------------------
    async def deliver(
        self,
        event: TrajectoryBuilt,
        session: Session,
        task: TaskRequest,
        quarantined: Verdict | None = None,
    ) -> None:
        sid, attempt = event.session_id, event.attempt
        trajectory = await self.load(event)
        record = await self.records.get(sid, attempt)
        result = record.result if record else None
        if result is None and quarantined is not None:
            why = quarantined.reason
            if quarantined.action != "given_up":
                why = (
                    f"quarantined: the evaluator's process died {quarantined.times} while "
                    f"evaluating it with {task.evaluator.name!r}; not run again"
                )
            result = EvalResult.error(why)
            result = await self.records.keep(sid, attempt, result)
        elif result is None:
            result = await self.evaluate(event, task, trajectory)
            result = await self.records.keep(sid, attempt, result)
        fresh = bool(record and record.fresh)
        if not (record and record.published):
            scored = logic.score(
                trajectory, result, num_samples=task.num_samples, index=session.index
            )
            await self.bus.send(
                S.trajectories(event.task_id),
                encode(scored),
                msg_id=logic.trajectory_msg_id(sid, attempt),
            )
            fresh = await self.records.mark_published(sid, attempt)
        t = await self.registry.transition(
            sid,
            event.outcome.final_state,
            from_=[SessionState.EVALUATING],
            **logic.final_fields(result),
        )
        if not t.ok:
            log.warning("%s: delivered, but the session is %s; not finalized", sid, t.from_state)
        log.info("%s: %s reward=%s %s", sid, result.status, result.reward, result.reason or "")
        await self.finalize(event, task, result, fresh)

    async def finalize(
        self,
        event: TrajectoryBuilt,
        task: TaskRequest,
        result: EvalResult | None = None,
        fresh: bool | None = None,
    ) -> None:
        """Announce the score, stop what is left, forget the kept result (idempotent).
        ``result`` and ``fresh``: the kept record's, when the caller has them."""
        sid, attempt = event.session_id, event.attempt
        if result is None or fresh is None:
            record = await self.records.get(sid, attempt)
            result = result or (record.result if record else None)
            fresh = bool(record and record.fresh)
        if result is not None:
            scored = logic.scored_event(event, result, time.time())
            await self.bus.send(
                S.SESSIONS_SCORED, encode(scored), msg_id=logic.scored_msg_id(sid, attempt)
            )
        await self.runtimes.release(task, event, fresh=fresh)
        await self.records.delete(sid, attempt)

    # -- evaluation -------------------------------------------------------------------
    async def evaluate(
        self, event: TrajectoryBuilt, task: TaskRequest, trajectory: Trajectory
    ) -> EvalResult:
        """The session's result; every failure is an ``error`` result with its reason."""
        plan = logic.plan(trajectory)
        if not plan.evaluate:
            return plan.result
        spec = task.evaluator
        try:
            evaluator = create_evaluator(self.evaluators, spec.name)
        except EvaluatorError as exc:
            return EvalResult.error(str(exc))
        kind = logic.runtime_kind(evaluator.needs_runtime, spec.runtime)
        ctx = EvalContext(
            trajectory=trajectory,
            artifacts=event.artifacts,
            task=task,
            config=dict(spec.config),
            side_calls=SessionSideCalls(self.bus, self.registry.redis, event.session_id),
        )
        if kind is None:
            return await run_evaluator(evaluator, ctx, spec.timeout_seconds, spec.name)
        try:
            acquired = await self.runtimes.acquire(
                kind, task, event, lambda: self.records.note_fresh(event.session_id, event.attempt)
            )
        except EvaluatorError as exc:
            return EvalResult.error(str(exc))
        ctx.runtime, ctx.runtime_kind, ctx.notes = acquired.runtime, acquired.kind, acquired.notes
        try:
            return await run_evaluator(evaluator, ctx, spec.timeout_seconds, spec.name)
        finally:  # this object holds node-side resources (bridge); ``finalize`` stops by id
            await acquired.runtime.stop(self.config.stop_grace_seconds)
