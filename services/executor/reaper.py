"""Ending sessions: the normal finish, and the reaper for sessions whose holder died.

A holder (pool during INIT and READY, executor during RUNNING) renews a lease in Redis;
when it stops renewing, any pool or executor that notices takes the expired lease
(exactly one wins), cleans the runtime if it can reach it, and retries the session if
the task allows — otherwise a RUNNING session is finished as ERROR so what it captured
is still built, and an earlier one ends as ERROR. A session that ended (cancelled, or
ended by a deadline) while its holder still had it only has its runtime stopped. The
runtimes cleaned are the session's own and, when the task prewarms its evaluator, the
fresh eval runtime a dead executor may have left.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from schemas import Artifacts, InitWork, Outcome, SessionFinished, SessionState, encode
from schemas import subjects as S
from services.common.bus import Bus
from services.common.registry import Registry
from services.executor.prewarm import prewarm_runtime_id

log = logging.getLogger(__name__)
ST = SessionState


async def finish_session(
    registry: Registry,
    bus: Bus,
    session,
    attempt: int,
    outcome: Outcome,
    reason: str | None,
    artifacts: Artifacts,
    eval_runtime_id: str | None,
) -> bool:
    t = await registry.transition(
        session.session_id, ST.POSTRUN, from_=[ST.RUNNING], outcome=outcome.value, reason=reason
    )
    if not t.ok:
        return False  # cancelled or reaped meanwhile
    event = SessionFinished(
        ts=time.time(),
        session_id=session.session_id,
        task_id=session.task_id,
        outcome=outcome,
        attempt=attempt,
        reason=reason,
        artifacts=artifacts,
        eval_runtime_id=eval_runtime_id,
    )
    await bus.publish(
        S.SESSIONS_FINISHED, encode(event), msg_id=f"finished:{session.session_id}:{attempt}"
    )
    return True


async def retry_session(registry: Registry, bus: Bus, session, reason: str) -> bool:
    """Back to REGISTERED with the next attempt, and new init work."""
    nxt = session.attempt + 1
    t = await registry.transition(
        session.session_id, ST.REGISTERED, attempt=nxt, reason=reason, node=None, runtime_id=None
    )
    if t.ok:
        work = InitWork(
            ts=time.time(),
            session_id=session.session_id,
            task_id=session.task_id,
            priority=session.priority,
            attempt=nxt,
        )
        await bus.publish(S.SESSIONS_INIT, encode(work), msg_id=f"init:{session.session_id}:{nxt}")
    return t.ok


class Reaper:
    def __init__(
        self, registry: Registry, bus: Bus, runtime_for: Callable, *, keep: Callable[[str], bool]
    ) -> None:
        self.registry, self.bus = registry, bus
        self.runtime_for = runtime_for  # (spec, session_id, runtime_id) -> Runtime
        self.keep = keep  # sessions this process itself holds (never reaped here)

    async def reap(self) -> int:
        reaped = 0
        for sid in await self.registry.expired_leases():
            if self.keep(sid) or not await self.registry.take_expired(sid):
                continue
            reaped += 1
            try:
                await self._reap_one(sid)
            except Exception:  # noqa: BLE001 - one bad session must not stop the reaper
                log.exception("reaping %s failed", sid)
        return reaped

    async def _reap_one(self, sid: str) -> None:
        session = await self.registry.get_session(sid)
        if session is None:
            return
        task = await self.registry.get_task(session.task_id)
        if session.state in (ST.CANCELLED, ST.ERROR) and task is not None:
            await self._stop_runtime(task, sid)  # ended while held, e.g. cancelled in READY
            return
        if task is None or session.state not in (ST.INITIALIZING, ST.READY, ST.RUNNING):
            return
        await self._stop_runtime(task, sid)
        reason = f"{session.state.lower()} holder lost (lease expired; node {session.node})"
        log.warning("reaping %s: %s", sid, reason)
        if session.attempt < task.spec.max_retries:
            await retry_session(self.registry, self.bus, session, reason)
        elif session.state == ST.RUNNING:  # build what was captured
            await finish_session(
                self.registry,
                self.bus,
                session,
                session.attempt,
                Outcome.ERROR,
                reason,
                Artifacts(),
                None,
            )
        else:
            await self.registry.transition(sid, ST.ERROR, from_=[session.state], reason=reason)

    async def _stop_runtime(self, task, sid: str) -> None:
        raw = await self.registry.redis.hget(S.key_session(sid), "runtime_id")
        ids = [raw.decode() if raw else f"{sid}-main"]
        # A dead executor may have left an eval runtime prewarming; nothing was handed
        # over (the session never finished), so it is stopped before any retry or finish.
        if eval_id := prewarm_runtime_id(task.spec, sid):
            ids.append(eval_id)
        for runtime_id in ids:
            with contextlib.suppress(Exception):  # clean what is reachable from this node
                await self.runtime_for(task.spec.runtime, sid, runtime_id).stop()
