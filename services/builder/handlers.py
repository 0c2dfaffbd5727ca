"""The builder's I/O shell: SessionFinished -> registry -> completions -> build -> store,
announce, advance. Every step is idempotent, so a crash anywhere and a redelivery give
exactly one TrajectoryBuilt:

- the build is deterministic and the object is written under a fixed name;
- TrajectoryBuilt is published with the dedupe id ``built:<session>:<attempt>`` (the
  sessions stream's duplicate window, 1 h, is far above ``ack_wait``);
- BUILDING -> EVALUATING is a CAS; a session found past BUILDING is acked and skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg

from proxy.callcount import numbered_calls
from schemas import (
    TERMINAL_STATES,
    BuilderSpec,
    CompletionRecord,
    ContractError,
    SessionFinished,
    SessionState,
    Trajectory,
    TrajectoryBuilt,
    decode,
    encode,
)
from schemas import subjects as S
from services.builder import logic, metrics
from services.builder.config import BuilderConfig
from services.builder.logic import Action, Decision
from services.builder.strategies import BuilderRegistry, default_registry
from services.common import cancels
from services.common.bus import Bus
from services.common.completions import read_completions
from services.common.consumer import Poison, Retry
from services.common.quarantine import Verdict
from services.common.registry import Registry

log = logging.getLogger(__name__)
# Sessions of at most this many records (no call, or one) are built on the event loop:
# about a millisecond at most, less than the thread hop; longer ones in a thread, where a
# long build blocks nothing.
INLINE_BUILD_RECORDS = 1


class Builder:
    def __init__(
        self,
        bus: Bus,
        registry: Registry,
        config: BuilderConfig,
        builders: BuilderRegistry | None = None,
    ) -> None:
        self.bus, self.registry, self.config = bus, registry, config
        self.builders = builders or default_registry()

    async def give_up(self, msg: Msg) -> str | None:
        """Asked before a session whose build died with the process is built again: not
        when its task was cancelled meanwhile (``cancels``)."""
        event = decode(await self.bus.payload(msg), SessionFinished)
        asked = await cancels.asked(self.registry.redis, event.session_id)
        if asked is None:
            return None
        return f"quarantined: cancelled ({asked}) after its build died with the builder"

    async def on_quarantined(self, msg: Msg, verdict: Verdict) -> None:
        """Building this session killed the service again and again: it is built by the
        fallback, masked, the reason recorded; the task's builder is not run again."""
        await self.on_finished(msg, quarantined=verdict)

    async def on_finished(self, msg: Msg, *, quarantined: Verdict | None = None) -> None:
        try:
            event = decode(await self.bus.payload(msg), SessionFinished)
        except (ContractError, LookupError) as exc:
            raise Poison(f"not a SessionFinished: {exc}") from None
        decision = await self.take(event)
        if decision.action is Action.POISON:
            raise Poison(decision.reason)
        if decision.action is Action.RETRY:
            metrics.BUILDS.labels("-", "retried").inc()
            raise Retry(self.config.retry_delay_seconds, decision.reason)
        if decision.action is Action.SKIP:
            log.info("%s: skipped: %s", event.session_id, decision.reason)
            metrics.BUILDS.labels("-", "skipped").inc()
            return
        why = quarantined.reason if quarantined is not None else None
        if quarantined is not None and quarantined.action != "given_up":
            why = f"quarantined: the builder's process died {quarantined.times} building it"
        await self.build(event, why)

    async def take(self, event: SessionFinished) -> Decision:
        """Move the session POSTRUN -> BUILDING (BEGIN) when it is there under the event's
        attempt, the usual case, tried first; else decide from the registry."""
        t = await self.registry.transition(
            event.session_id,
            SessionState.BUILDING,
            from_=[SessionState.POSTRUN],
            expect_attempt=event.attempt,
        )
        if t.ok:
            return Decision(Action.BEGIN)
        again = logic.decide(await self.registry.get_session(event.session_id), event)
        if again.action is Action.BEGIN:  # changed and changed back: look again later
            return Decision(Action.RETRY, "session changed while taking it")
        return again

    async def build(self, event: SessionFinished, quarantined: str | None = None) -> Trajectory:
        start = time.perf_counter()
        trajectory, records = await self.make_from(event, quarantined)
        await self.store(trajectory, event)
        await self.announce(trajectory, event)
        await self.advance(event)
        seconds = time.perf_counter() - start
        metrics.observe(trajectory, seconds)
        mine, _ = logic.split_attempt(logic.first_of_each_seq(records), event.attempt)
        metrics.observe_tool_parse(trajectory.harness, mine, trajectory.task_id)
        st = trajectory.stats
        log.info(
            "%s: built (%s) chains=%d tokens=%d merge_ratio=%.2f breaks=%s intact=%s in %.3fs",
            event.session_id,
            trajectory.builder,
            st.chains,
            st.tokens,
            st.merge_ratio,
            st.breaks,
            trajectory.intact,
            seconds,
        )
        return trajectory

    async def make(self, event: SessionFinished) -> Trajectory:
        return (await self.make_from(event))[0]

    async def make_from(
        self, event: SessionFinished, quarantined: str | None = None
    ) -> tuple[Trajectory, list[CompletionRecord]]:
        """The trajectory, and the records it was made from (``quarantined``: why the
        task's builder is not run, ``logic.build_trajectory``)."""
        spec = await self.builder_spec(event.task_id)
        records, problems = await self.settled_records(event.session_id, event.seq_floor)
        args = (event, spec, records, self.builders, problems, quarantined)
        if len(records) <= INLINE_BUILD_RECORDS:
            return logic.build_trajectory(*args), records
        # CPU-bound: off the event loop, so in-progress acks keep flowing meanwhile.
        built = await asyncio.to_thread(logic.build_trajectory, *args)
        return built, records

    async def settled_records(self, session_id: str, floor: int = 0) -> tuple[list, list[str]]:
        """The session's records once every call the proxy numbered has one (committed,
        void or aborted). No call starts after the session left RUNNING (its token died
        with that change), but one in flight then still commits its record: it is waited
        for, up to ``settle_seconds`` (a harness that exits or is killed hangs up, and
        the proxy records the abort at once); a number still missing after that is
        reported as a lost call. Numbers below ``floor`` are earlier attempts'."""
        cfg = self.config
        deadline = time.monotonic() + cfg.settle_seconds
        while True:
            records, problems = await read_completions(
                self.bus, session_id, batch=cfg.read_batch, timeout=cfg.read_timeout_seconds
            )
            numbered = await numbered_calls(self.registry.redis, session_id)
            if logic.all_numbered_present(records, numbered, floor) or time.monotonic() > deadline:
                return records, problems
            await asyncio.sleep(0.1)

    async def builder_spec(self, task_id: str) -> BuilderSpec:
        spec = await self.registry.task_spec(task_id)
        if spec is None:
            raise Poison(f"task {task_id!r} is not in the registry: no builder spec")
        return spec.builder

    async def store(self, trajectory: Trajectory, finished: SessionFinished | None = None) -> None:
        store = await self.bus.blobs()
        sid, attempt = trajectory.session_id, trajectory.attempt
        await store.put(S.trajectory_object(sid, attempt), encode(trajectory))
        if finished is not None:  # what people read of the run, past a restart
            await store.put(S.artifacts_object(sid, attempt), encode(finished.artifacts))

    async def announce(self, trajectory: Trajectory, finished: SessionFinished) -> None:
        event = TrajectoryBuilt(
            ts=time.time(),
            session_id=trajectory.session_id,
            task_id=trajectory.task_id,
            outcome=trajectory.outcome,
            attempt=trajectory.attempt,
            artifacts=finished.artifacts,  # the evaluator applies the diff, reads files
            eval_runtime_id=finished.eval_runtime_id,
            node=finished.node,
            trajectory=trajectory,  # the evaluator's copy: no object-store read per session
        )
        msg_id = logic.built_msg_id(trajectory.session_id, trajectory.attempt)
        await self.bus.send(event.subject, encode(event), msg_id=msg_id)

    async def advance(self, event: SessionFinished) -> None:
        t = await self.registry.transition(
            event.session_id, SessionState.EVALUATING, from_=[SessionState.BUILDING]
        )
        # EVALUATING or past it: the evaluator, holding the announced trajectory, made the
        # move first (this one lagged, e.g. through a registry outage)
        if (
            not t.ok
            and t.from_state != SessionState.EVALUATING
            and t.from_state not in TERMINAL_STATES
        ):
            log.warning(
                "%s: built, but the session is %s; not moved to EVALUATING",
                event.session_id,
                t.from_state,
            )
