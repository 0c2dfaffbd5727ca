"""Finishing a session: the one way a session reaches POSTRUN, so it is built and scored.

The executor finishes the sessions it ran. A session that fails before it ever runs
(INIT failed, its holder died in INITIALIZING or READY, its deadline passed while it
waited) is finished the same way with outcome ERROR and no artifacts: the builder turns
its (empty) capture into a trajectory and the evaluator delivers it with reward 0, so a
trainer's group of ``num_samples`` is always whole. A cancelled session (by the user,
or by early stop) is finished the same way too, from before or during its run, with
outcome CANCELLED and whatever its capture holds: its final state is CANCELLED once its
trajectory is delivered.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from schemas import Artifacts, Outcome, SessionFinished, SessionState, encode
from schemas import subjects as S
from services.common.bus import Bus
from services.common.faults import REGISTRY_DOWN, TRANSIENT, is_transient, retry_faults
from services.common.outbox import hand_off
from services.common.redact import redact
from services.common.registry import Outgoing, Registry

__all__ = ["TRANSIENT", "is_transient"]  # where the pool has them from
ST = SessionState
BEFORE_RUN = (ST.REGISTERED, ST.INITIALIZING, ST.READY)
CANCELLABLE = (*BEFORE_RUN, ST.RUNNING)  # later, the session is already ending

FINISH_RETRY_S = 30.0  # longer than a registry restart; the holder's lease is renewed meanwhile


def may_retry(session, spec, *, transient: bool) -> bool:
    """Whether a failed attempt is tried again: up to the task's ``max_retries`` for any
    failure, and ``infra_retries`` more when the fault was the system's (a holder lost,
    the bus or registry down), so an operator's bad day does not cost a trainer samples.
    Bounded either way: ``attempt`` counts every retry of the session."""
    budget = spec.max_retries + (spec.infra_retries if transient else 0)
    return session.attempt < budget


async def finish_session(
    registry: Registry,
    bus: Bus,
    session,
    attempt: int,
    outcome: Outcome,
    reason: str | None,
    artifacts: Artifacts,
    eval_runtime_id: str | None,
    *,
    from_: Iterable[SessionState] = (ST.RUNNING,),
    node: str | None = None,
    release_lease: str | None = None,
) -> bool:
    """POSTRUN (from one of ``from_``) and the SessionFinished event; False when the
    session was no longer there to finish (cancelled or ended meanwhile). ``node``: the
    finisher's, where ``eval_runtime_id`` lives. ``release_lease``: the holder's name,
    whose lease the POSTRUN change drops (True: it is dropped)."""
    reason = redact(reason)
    sid = session.session_id
    event = SessionFinished(
        ts=time.time(),
        session_id=session.session_id,
        task_id=session.task_id,
        outcome=outcome,
        attempt=attempt,
        reason=reason,
        artifacts=artifacts,
        eval_runtime_id=eval_runtime_id,
        node=node,
        # as read for this attempt; else 0: every number counts (never a gap overlooked)
        seq_floor=session.seq_floor if session.attempt == attempt else 0,
    )
    # kept in the outbox with the POSTRUN change: the builder hears of it after any outage
    out = Outgoing(S.SESSIONS_FINISHED, encode(event), f"finished:{sid}:{attempt}")
    if not await _to_postrun(registry, sid, attempt, outcome, reason, from_, release_lease, out):
        return False
    await hand_off(registry, bus, out)
    return True


async def _to_postrun(
    registry: Registry,
    session_id: str,
    attempt: int,
    outcome: Outcome,
    reason: str | None,
    from_: Iterable[SessionState],
    release_lease: str | None = None,
    outbox: Outgoing | None = None,
) -> bool:
    """The POSTRUN transition, tried again while the registry is unreachable (a restart,
    an outage: up to ``FINISH_RETRY_S``) instead of losing a finished run to ERROR."""
    failed: list[BaseException] = []  # the tries the registry did not answer
    t = await retry_faults(
        # fenced by attempt: a holder cut off past its lease, back after the session was
        # retried elsewhere, must not finish the new attempt with the old one's results
        lambda: registry.transition(
            session_id,
            ST.POSTRUN,
            from_=list(from_),
            expect_attempt=attempt,
            release_lease=release_lease,
            outbox=outbox,
            outcome=outcome.value,
            reason=reason,
        ),
        seconds=FINISH_RETRY_S,
        faults=REGISTRY_DOWN,
        first_delay=0.2,
        max_delay=2.0,
        on_retry=lambda exc, _: failed.append(exc),
    )
    if t.ok or not failed:
        return t.ok
    # an earlier try may have been applied, its reply lost with the connection
    now = await registry.get_session(session_id)
    return now is not None and (now.state, now.attempt, now.outcome, now.reason) == (
        ST.POSTRUN,
        attempt,
        outcome,
        reason,
    )


async def fail_before_run(
    registry: Registry, bus: Bus, session, reason: str, from_: Iterable[SessionState]
) -> bool:
    """End a session that never ran as ERROR, through POSTRUN: it still yields its
    (empty, ERROR) trajectory."""
    return await finish_session(
        registry, bus, session, session.attempt, Outcome.ERROR, reason, Artifacts(), None,
        from_=from_,
    )  # fmt: skip


async def cancel_session(registry: Registry, bus: Bus, session, reason: str) -> bool:
    """End a session that has not run yet or is running as CANCELLED, through POSTRUN:
    its token dies with the change (no call is served or captured after it) and it still
    yields its trajectory, built from what was captured (empty if nothing was), so its
    group is whole. Fenced by state and attempt: False if it moved on meanwhile."""
    return await finish_session(
        registry, bus, session, session.attempt, Outcome.CANCELLED, reason, Artifacts(), None,
        from_=CANCELLABLE,
    )  # fmt: skip
