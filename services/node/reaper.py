"""Ending sessions: the normal finish, and the reaper for sessions whose holder died.

A holder (pool during INIT and READY, executor during RUNNING) renews a lease in Redis;
when it stops renewing, any pool or executor that notices takes the expired lease
(exactly one wins), cleans the runtime if it can reach it, and retries the session
(a lost holder is the system's fault: ``max_retries`` + ``infra_retries`` attempts in
all) — otherwise a RUNNING session is finished as ERROR so what it captured
is still built, and an earlier one is finished as ERROR with nothing captured, so it
still yields its empty trajectory (``services.common.finish``). A session that ended
(cancelled, or ended by a deadline) while its holder still had it only has its runtime
stopped. A
held-state session with no lease at all (its holder died between two steps) is given an
expired one and reaped the same way (``Registry.expire_unleased``). The runtimes cleaned
are the session's current attempt's own and, when the task prewarms its evaluator, the
fresh eval runtime a dead executor may have left (runtime ids carry the attempt: an
older attempt's holder, back from a cut, stops only its own, never the next attempt's
on the same node).

A reaper on another host cannot reach a dead node's runtimes: when the node's pool or
executor starts again, it sweeps its work dir (``sweep_leftovers``) and stops what no
live process holds any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable

import redis.exceptions

from schemas import Artifacts, InitWork, Outcome, SessionState, encode
from schemas import subjects as S
from schemas.task import LocalRuntime
from services.common.bus import Bus
from services.common.faults import REGISTRY_DOWN, registry_refuses_writes
from services.common.finish import fail_before_run, finish_session, may_retry
from services.common.outbox import hand_off
from services.common.registry import Outgoing, Registry, new_token
from services.node.prewarm import ROLE as EVAL_ROLE
from services.node.prewarm import prewarm_runtime_id
from services.node.session import SessionPaths
from services.runtimes.factory import RuntimeName, parse_runtime_id, runtime_id_for

log = logging.getLogger(__name__)
ST = SessionState


async def retry_session(registry: Registry, bus: Bus, session, reason: str) -> bool:
    """Back to REGISTERED with the next attempt, and new init work (kept in the outbox
    with the change: a bus outage or a crash right after it cannot strand the session)."""
    nxt = session.attempt + 1
    work = InitWork(
        ts=time.time(),
        session_id=session.session_id,
        task_id=session.task_id,
        priority=session.priority,
        attempt=nxt,
    )
    out = Outgoing(S.SESSIONS_INIT, encode(work), f"init:{session.session_id}:{nxt}")
    t = await registry.transition(
        session.session_id,
        ST.REGISTERED,
        expect_attempt=session.attempt,  # the attempt read: not one begun since by another
        attempt=nxt,
        token=new_token(),  # the old attempt's harness, if still alive, is shut out
        lease_owner=None,  # nor can its holder renew a lease on the new attempt
        reason=reason,
        node=None,
        runtime_id=None,
        outbox=out,
    )
    if t.ok:
        await hand_off(registry, bus, out)
    return t.ok


class Reaper:
    def __init__(
        self,
        registry: Registry,
        bus: Bus,
        runtime_for: Callable,
        *,
        keep: Callable[[str], bool],
        orphan_after: float = 60.0,
    ) -> None:
        self.registry, self.bus = registry, bus
        self.runtime_for = runtime_for  # (spec, session_id, runtime_id) -> Runtime
        self.keep = keep  # sessions this process itself holds (never reaped here)
        # A held-state session with no lease at all, unchanged this long, is an orphan
        # (the holders' lease period: a live holder has taken its lease long before).
        self.orphan_after = orphan_after
        self._unreachable = False  # the last reap could not reach the registry
        self._quiet_until = 0.0  # monotonic: judge no lease before this

    async def reap(self) -> int:
        try:
            if await self._registry_just_back():
                return 0
            return await self._reap_expired()
        except REGISTRY_DOWN:
            self._unreachable = True
            raise
        except redis.exceptions.ResponseError as exc:
            if registry_refuses_writes(exc):  # no holder could renew either
                self._unreachable = True
            raise

    async def _registry_just_back(self) -> bool:
        """Whether the registry was away (restarted, or out of this process's reach)
        less than a lease period ago. No holder could renew meanwhile, so every lease may
        have lapsed with its holder alive: reaping then would retry live sessions and
        use up their ``infra_retries`` (the chaos test's lease-expiry ERRORs). Live
        holders renew every third of a period, so after one period what is expired is
        truly lost."""
        now = time.monotonic()
        if self._unreachable:
            self._unreachable, self._quiet_until = False, now + self.orphan_after
        if now < self._quiet_until:
            return True
        # whole seconds, rounded down: up at most one more than it says
        return await self.registry.server_uptime() + 1 < self.orphan_after

    async def _reap_expired(self) -> int:
        orphans = await self.registry.expire_unleased(HELD, self.orphan_after)
        if orphans:
            log.warning("sessions held by nobody (no lease): %s", ", ".join(orphans))
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
            await self._stop_runtime(task, session)  # ended while held, e.g. cancelled in READY
            return
        if task is None or session.state not in (ST.INITIALIZING, ST.READY, ST.RUNNING):
            return
        await self._stop_runtime(task, session)
        reason = f"{session.state.lower()} holder lost (lease expired; node {session.node})"
        log.warning("reaping %s: %s", sid, reason)
        if may_retry(session, task.spec, transient=True):  # the system's fault, not the task's
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
        else:  # it never ran: an empty ERROR trajectory keeps its group whole
            await fail_before_run(self.registry, self.bus, session, reason, [session.state])

    async def _stop_runtime(self, task, session) -> None:
        """Stop the runtimes of the attempt read (the lost holder's), by their ids."""
        sid, attempt = session.session_id, session.attempt
        ids = [await self.registry.runtime_id(sid) or runtime_id_for(sid, attempt)]
        # A dead executor may have left an eval runtime prewarming; nothing was handed
        # over (the session never finished), so it is stopped before any retry or finish.
        if eval_id := prewarm_runtime_id(task.spec, sid, attempt):
            ids.append(eval_id)
        for runtime_id in ids:
            with contextlib.suppress(Exception):  # clean what is reachable from this node
                await self.runtime_for(task.spec.runtime, sid, runtime_id).stop()


# -- start-up sweep: runtimes a dead pool or executor of this node left behind ---------
ENDED = (ST.COMPLETED, ST.TIMEOUT, ST.ERROR, ST.CANCELLED)
HELD = (ST.INITIALIZING, ST.READY, ST.RUNNING)
AFTER_RUN = (ST.POSTRUN, ST.BUILDING, ST.EVALUATING)  # the evaluator may use a runtime
KEEP, STOP, FILES = "keep", "stop", "files"


def keeps_live(spec) -> bool:
    """Whether a finished run hands its live runtime to the evaluator (as the executor)."""
    ev = spec.evaluator
    return ev.runtime == "live" and ev.name != "session_completed"


def leftover_action(session, name: RuntimeName, spec, node: str, leased: bool) -> str:
    """What a starting pool or executor does with a runtime found in its node's work dir:
    KEEP it, STOP it (kill its processes, remove it) or remove its FILES only.

    ``name``: the runtime's session, attempt and role (main, eval); ``spec``: the task's,
    None if gone; ``leased``: the session has a lease, live or expired (its holder, or a
    reaper here, stops it)."""
    if session is None:
        return STOP  # nobody will ever stop it
    if name.attempt != session.attempt:
        # An earlier attempt's: the session went on without it, and its id is its own
        # (no later attempt's process carries it), so even one on this host is stopped.
        return STOP
    if leased:
        return KEEP
    state, here = session.state, session.node == node
    if state in ENDED:
        return STOP
    if state in HELD and here:
        return KEEP  # just admitted, or being reaped
    if state in AFTER_RUN and here:
        in_use = name.role == EVAL_ROLE or (spec is not None and keeps_live(spec))
        return KEEP if in_use else STOP
    # This attempt is the registry's on another node (or not admitted): none of ours,
    # yet its tag may be on that node's processes on this host: remove its files only.
    return FILES


async def sweep_leftovers(
    registry: Registry, work_dir: str, node: str, runtime_for: Callable
) -> dict[str, str]:
    """Stop the runtimes in this node's work dir that no live process holds any more
    (session dirs, their process groups and tagged processes, containers with a record
    here). Returns {runtime_id: action} for what it did not keep. A name that is no
    runtime id (``parse_runtime_id``) is left alone."""
    root = SessionPaths.of(work_dir, "-").sessions_dir
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return {}
    done: dict[str, str] = {}
    for runtime_id in names:
        name = parse_runtime_id(runtime_id)
        if name is None:
            log.warning("sweep: %s is no runtime id, left alone", root / runtime_id)
            continue
        sid = name.session_id
        try:
            # The lease first: a session admitted after this read is INITIALIZING here.
            leased = await registry.redis.zscore(S.KEY_LEASES, sid) is not None
            session = await registry.get_session(sid)
            task = await registry.get_task(session.task_id) if session else None
            spec = task.spec if task else None
            action = leftover_action(session, name, spec, node, leased)
            if action == STOP:
                runtime_spec = spec.runtime if spec else LocalRuntime()  # tags and files
                await runtime_for(runtime_spec, sid, runtime_id).cancel()
            elif action == FILES:
                await asyncio.to_thread(shutil.rmtree, root / runtime_id, True)
        except Exception:  # noqa: BLE001 - one bad leftover must not stop the start-up
            log.exception("sweeping %s failed", runtime_id)
            continue
        if action != KEEP:
            log.warning("swept %s (%s): no live process holds it", runtime_id, action)
            done[runtime_id] = action
    return done
