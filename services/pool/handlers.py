"""The runtime pool's I/O shell (INIT stage of one node).

Init work is fetched into a local priority queue (held messages are kept alive), and
started only while the node's bounds allow (see ``logic``). The bound check and the
REGISTERED -> INITIALIZING transition happen under one lock, so the pool never admits
more than it may, and nothing once it is stopping. A prepared runtime is handed to the
node's executor as ``ReadyWork``; a preparation whose session went on without it (a
later attempt, or ended) is cancelled at the next lease renewal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout

from schemas import (
    InitWork,
    NodeHeartbeat,
    ReadyWork,
    SessionState,
    SessionStateChanged,
    decode,
    encode,
)
from schemas import subjects as S
from services.common.bus import Bus, ensure_consumer, work_consumer
from services.common.faults import TRANSIENT, TRANSIENT_WAIT_S, retry_faults
from services.common.finish import fail_before_run, is_transient, may_retry
from services.common.plugins import Registry as PluginRegistry
from services.common.registry import Registry
from services.node.artifacts import baseline_command, takes_diff
from services.node.harnesses import Harness
from services.node.heartbeat import (
    STAGE_RESULTS,
    STAGE_SECONDS,
    STAGE_WAIT,
    node_stages,
    send_heartbeat,
)
from services.node.reaper import retry_session
from services.node.session import SessionPaths, harness_context, node_runtime
from services.pool import logic
from services.pool.backpressure import EngineWatch
from services.pool.config import PoolConfig
from services.runtimes.base import Runtime
from services.runtimes.errors import SandboxError
from services.runtimes.factory import runtime_id_for
from services.runtimes.prepare import run_prepare

log = logging.getLogger(__name__)
ST = SessionState
POOL_STAGES = {"INIT": ST.INITIALIZING, "READY": ST.READY}
# A READY session that moves to one of these never reaches an executor: its runtime,
# prepared and detached by this pool, is the pool's to stop.
LEFT_READY = (ST.CANCELLED, ST.ERROR, ST.POSTRUN)  # POSTRUN from READY: ended, never ran
READY_POLL_SECONDS = 0.2  # a prepared runtime waiting for room re-checks at least this often


class Superseded(Exception):
    """A preparation cancelled because its session no longer wants it."""


@dataclass
class Preparation:
    task: asyncio.Task
    unwanted: str = ""  # why a renewal cancelled it (the session's state or attempt now)


class RuntimePool:
    def __init__(
        self, bus: Bus, registry: Registry, config: PoolConfig, harnesses: PluginRegistry[Harness]
    ) -> None:
        self.bus, self.registry, self.config, self.harnesses = bus, registry, config, harnesses
        self.node = config.node
        self.owner = f"pool:{self.node}:{uuid.uuid4().hex[:8]}"
        self.limits = logic.Limits(config.max_init, config.ready_buffer, config.max_run)
        self.queue: logic.PriorityQueue[tuple[InitWork, Msg]] = logic.PriorityQueue()
        self.initializing: dict[str, Runtime] = {}
        # the init work of the INITs running now, by session and attempt (an old
        # attempt's INIT may still unwind beside the next one's)
        self._init_msgs: dict[tuple[str, int], Msg] = {}
        # the preparations running now (runtime start, prepare, harness install), by
        # session and attempt: a lease renewal cancels one its session no longer wants
        self._preparing: dict[tuple[str, int], Preparation] = {}
        self._jobs: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._ready_freed = asyncio.Event()  # a READY session was taken or ended
        # The node's READY count as last read under the lock, plus this pool's own moves
        # to READY since: (count, generation, monotonic time of the read). Only this pool
        # adds to READY on its node, so until a session leaves READY (which bumps the
        # generation) the count can only be too high, never too low: waiters for READY
        # room need not each re-read it on every wake-up (every hand-over woke them all
        # into a count of which one at most could win). Kept at most READY_POLL_SECONDS,
        # in case the event of a session leaving READY was missed.
        self._ready_seen: tuple[int, int, float] | None = None
        self._ready_gen = 0
        # The last admission left work queued for want of a held place (not of an INIT
        # slot, whose end dispatches anyway): the end of a run admits again at once.
        self._waits_for_run = False
        # READY sessions whose hand-off this process published: the only READY ones it
        # renews (one it failed to hand off, or a dead predecessor's, must expire).
        self.handed_off: set[str] = set()
        # Init work a dead pool had fetched comes back after ack_wait: it follows the
        # lease (a live pool keeps its messages in progress every third of it), so a pool
        # killed with a full queue delays those sessions by a lease, not by a minute.
        self.ack_wait = max(config.lease_seconds, 1.0)

    # -- main loop --------------------------------------------------------------------
    async def run(self, *, drain: bool = False) -> None:
        cfg = work_consumer(
            S.CONSUMER_POOL_INIT,
            S.SESSIONS_INIT,
            ack_wait=self.ack_wait,
            max_deliver=-1,
            max_ack_pending=100_000,
        )
        await ensure_consumer(self.bus.js, S.STREAM_SESSIONS, cfg)
        sub = await self.bus.js.pull_subscribe_bind(S.CONSUMER_POOL_INIT, S.STREAM_SESSIONS)
        keepalive = asyncio.create_task(self._keep_queue_alive())
        try:
            while not self._stopping.is_set():
                got = await self._fetch(sub, timeout=0.2 if drain else 1.0)
                await self.dispatch()
                if drain and not got and not self.queue and not self._jobs:
                    return
                if not got and self._jobs:
                    await asyncio.wait(self._jobs, timeout=0.2)
        finally:
            keepalive.cancel()
            if self._jobs:
                await asyncio.gather(*self._jobs, return_exceptions=True)
            with contextlib.suppress(Exception):  # a pull sub left behind blocks drain()
                await sub.unsubscribe()

    def stop(self) -> None:
        self._stopping.set()

    async def _fetch(self, sub, timeout: float) -> int:
        room = self.config.prefetch - len(self.queue)
        if room <= 0:
            await asyncio.sleep(timeout)
            return 0
        try:
            msgs = await sub.fetch(room, timeout=timeout)
        except (TimeoutError, NatsTimeout):
            return 0
        for msg in msgs:
            try:
                item = decode(msg.data, InitWork)
            except ValueError as exc:
                from services.common.consumer import dead_letter

                await dead_letter(self.bus, S.STREAM_SESSIONS, msg, f"bad init work: {exc}")
                await msg.term()
                continue
            self.queue.push(item.priority, (item, msg))
        return len(msgs)

    async def _keep_queue_alive(self) -> None:
        """Every third of ``ack_wait``: the init work queued here and that of the INITs
        running (one loop for both: a task per INIT cost a start and a cancel each)."""
        while True:
            await asyncio.sleep(self.ack_wait / 3)
            held = [msg for _, msg in self.queue.items()] + list(self._init_msgs.values())
            for msg in held:
                with contextlib.suppress(Exception):
                    await msg.in_progress()

    # -- admission ----------------------------------------------------------------------
    async def dispatch(self) -> int:
        """Start as many queued INITs as the bounds allow; returns how many started.
        Every admission goes through here (the main loop, the end of an INIT or of a run,
        the periodic job): a stopping pool admits nothing."""
        async with self._lock:
            if not self.queue or self._stopping.is_set():
                return 0
            # The flag is set by an ``EngineWatch`` (this node's or another's) or by an
            # operator; read with the counts, in one round trip.
            counts, struggling = await self.registry.admission_view(
                self.node, [ST.INITIALIZING, ST.READY, ST.RUNNING]
            )
            if struggling:
                return 0
            stages = (counts["INITIALIZING"], counts["READY"], counts["RUNNING"])
            room = logic.room_to_init(*stages, self.limits)
            started = 0
            while started < room and self.queue and not self._stopping.is_set():
                item, msg = self.queue.pop()
                if await self._admit(item, msg):
                    started += 1
            self._waits_for_run = bool(self.queue) and logic.held_by_runs(*stages, self.limits)
            return started

    def engine_watch(self) -> EngineWatch | None:
        """The writer of the backpressure signal, when this pool has engines to watch."""
        cfg = self.config
        urls = cfg.watched_engines()
        if not urls:
            return None
        return EngineWatch(
            self.registry.redis,
            urls,
            high=cfg.backpressure_queue,
            low=cfg.backpressure_resume,
            ttl_seconds=cfg.backpressure_ttl_seconds,
        )

    async def _admit(self, item: InitWork, msg: Msg) -> bool:
        t = await self.registry.transition(
            item.session_id,
            ST.INITIALIZING,
            from_=[ST.REGISTERED],
            expect_attempt=item.attempt,  # an earlier attempt's work, redelivered: no
            lease=(self.owner, self.config.lease_seconds),  # one step: a crash leaves a lease
            node=self.node,
        )
        if not t.ok:  # cancelled, already taken, an earlier attempt's work, or gone
            await msg.ack()
            return False
        STAGE_WAIT.labels(self.node, "init").observe(max(0.0, time.time() - item.ts))
        job = asyncio.create_task(self._init(item, msg))
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        return True

    # -- one INIT -----------------------------------------------------------------------
    async def _init(self, item: InitWork, msg: Msg) -> None:
        sid = item.session_id
        self._init_msgs[(sid, item.attempt)] = msg
        result, started = "failed", time.monotonic()
        # Runtime ids carry the attempt, and each attempt is admitted once: no process
        # of this one's runtime can exist before its first try (only a rerun in place).
        in_place_until, fresh = started + TRANSIENT_WAIT_S, True
        try:
            while True:
                try:
                    result = await self._init_once(item, fresh)
                    return
                except Superseded as exc:
                    result = "superseded"
                    await self._init_superseded(item, str(exc))
                    return
                except Exception as exc:  # noqa: BLE001 - an INIT failure is recorded, never fatal
                    runtime = self._runtime_of(item)
                    if await self._rerun_in_place(item, runtime, exc, in_place_until):
                        fresh = False  # the try just cancelled may have left processes
                        continue
                    await self._init_failed(item, runtime, exc)
                    return
        finally:
            self._init_msgs.pop((sid, item.attempt), None)
            if self._runtime_of(item) is not None:
                del self.initializing[sid]
            STAGE_SECONDS.labels(self.node, "init").observe(time.monotonic() - started)
            STAGE_RESULTS.labels(self.node, "init", result).inc()
            with contextlib.suppress(Exception):
                await msg.ack()
            await self.dispatch()

    def _runtime_of(self, item: InitWork) -> Runtime | None:
        """This INIT's runtime, unless a later attempt's INIT here has taken the session's
        place (this pool, back from a cut, admitted the next attempt while this one
        unwinds): the old attempt's failure or end must not stop or drop that one."""
        runtime = self.initializing.get(item.session_id)
        mine = runtime_id_for(item.session_id, item.attempt)
        return runtime if runtime is not None and runtime.runtime_id == mine else None

    async def _init_once(self, item: InitWork, fresh: bool) -> str:
        """One try at INIT: prepare the sandbox, go READY, hand it to the executor.
        ``fresh``: no earlier try of this session can have left processes behind."""
        sid = item.session_id
        spec = await self.registry.task_spec(item.task_id)
        session = await self.registry.get_session(sid)
        paths = SessionPaths.of(self.config.work_dir, sid)
        runtime = node_runtime(
            self.config,
            spec.runtime,
            sid,
            attempt=item.attempt,
            harness=spec.agent.harness,
            token=session.token if session is not None else None,
        )
        self.initializing[sid] = runtime
        await self._prepare_while_wanted(item, self._prepare(runtime, spec, session, paths, fresh))
        if not await self._become_ready(item, runtime):  # cancelled, or retried, meanwhile
            await runtime.cancel()
            return "cancelled"
        work = ReadyWork(
            ts=time.time(),
            session_id=sid,
            task_id=item.task_id,
            node=self.node,
            runtime_id=runtime.runtime_id,
            priority=item.priority,
            attempt=item.attempt,
        )
        await runtime.detach()  # the executor adopts it; this process lets go
        # A fresh handle on the detached sandbox, to stop it if the hand-off fails.
        self.initializing[sid] = node_runtime(self.config, spec.runtime, sid, runtime.runtime_id)
        await self.bus.publish_retrying(
            S.sessions_ready(self.node), encode(work), msg_id=f"ready:{sid}:{item.attempt}"
        )
        self.handed_off.add(sid)
        return "ready"

    async def _rerun_in_place(
        self, item: InitWork, runtime: Runtime | None, exc: Exception, until: float
    ) -> bool:
        """Whether an INIT that failed on a fault of the system (the registry or the bus
        away) is tried again here, in the same attempt: the holder is alive and the task
        did nothing wrong, so it must not use up the session's ``infra_retries`` (three
        such blips in one session's life ended it ERROR under the chaos test). Only while
        the session is still INITIALIZING under this attempt, and up to ``until``."""
        if not is_transient(exc) or time.monotonic() >= until:
            return False
        log.warning(
            "INIT of %s hit a fault of the system (%r); again in place", item.session_id, exc
        )
        if runtime is not None:
            with contextlib.suppress(Exception):
                await runtime.cancel()
        try:
            now = await retry_faults(
                lambda: self.registry.get_session(item.session_id),
                seconds=max(0.0, until - time.monotonic()),
            )
        except TRANSIENT:
            return False
        return now is not None and now.state == ST.INITIALIZING and now.attempt == item.attempt

    async def _become_ready(self, item: InitWork, runtime: Runtime) -> bool:
        """INITIALIZING -> READY once the READY buffer has room; False if the session
        ended meanwhile, or went on without this holder (its lease lapsed while cut off:
        another attempt, maybe INITIALIZING on another node, must not get this sandbox).
        Checked and moved under the admission lock (one pool per node), so READY never
        exceeds its bound even while the executor lags."""
        sid = item.session_id
        # The session is read at most every READY_POLL_SECONDS while waiting, the first
        # time after one: a move to READY checks its state anyway, and a cancel stops
        # the runtime, which ends the wait without a read.
        look_at = time.monotonic() + READY_POLL_SECONDS
        while True:
            self._ready_freed.clear()  # before counting: a later hand-over wakes us
            async with self._lock:
                ready = await self._ready_count()
                if logic.ready_room(ready, self.limits) > 0:
                    t = await self.registry.transition(
                        sid,
                        ST.READY,
                        from_=[ST.INITIALIZING],
                        expect_attempt=item.attempt,
                        runtime_id=runtime.runtime_id,
                    )
                    if t.ok and self._ready_seen is not None:
                        count, gen, read_at = self._ready_seen
                        self._ready_seen = (count + 1, gen, read_at)
                    return t.ok
            if runtime.state != "running":  # cancelled (a cancel message, or stopping)
                return False
            if time.monotonic() >= look_at:  # not on every wake-up: each hand-over wakes all
                now = await self.registry.get_session(sid)
                if now is None or (now.state, now.attempt) != (ST.INITIALIZING, item.attempt):
                    return False
                look_at = time.monotonic() + READY_POLL_SECONDS
            with contextlib.suppress(TimeoutError):  # the wake-up is a hint; poll anyway
                await asyncio.wait_for(self._ready_freed.wait(), READY_POLL_SECONDS)

    async def _ready_count(self) -> int:
        """The node's READY count, read again only when a session left READY since the
        last read (or it is READY_POLL_SECONDS old). Called under the admission lock."""
        seen, gen = self._ready_seen, self._ready_gen
        if seen is not None and seen[1] == gen and time.monotonic() - seen[2] < READY_POLL_SECONDS:
            return seen[0]
        read_at = time.monotonic()
        counts = await self.registry.node_stage_counts(self.node, [ST.READY])
        self._ready_seen = (counts["READY"], gen, read_at)  # gen as before the read: an
        return counts["READY"]  # event during it makes the next waiter read again

    def _ready_left(self) -> None:
        """A session left READY (somewhere): the cached count may be too high."""
        self._ready_gen += 1
        self._ready_freed.set()

    async def _prepare_while_wanted(self, item: InitWork, prepare: Coroutine) -> None:
        """Run ``prepare`` as a task a lease renewal cancels once the session went on
        without this attempt (``_stop_unwanted``): a runtime start or a prepare may take
        minutes (a docker pull, a hung start) and looks at no session meanwhile.
        Raises ``Superseded`` when so cancelled."""
        key = (item.session_id, item.attempt)
        prep = self._preparing[key] = Preparation(asyncio.ensure_future(prepare))
        try:
            await prep.task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not prep.unwanted or (current is not None and current.cancelling()):
                raise  # this INIT itself cancelled
            raise Superseded(prep.unwanted) from None
        finally:
            if self._preparing.get(key) is prep:
                del self._preparing[key]

    async def _prepare(
        self, runtime: Runtime, spec, session, paths: SessionPaths, first_attempt: bool
    ) -> None:
        await runtime.start(first_attempt=first_attempt)
        logs = await run_prepare(runtime, spec.runtime.prepare)
        paths.logs.mkdir(parents=True, exist_ok=True)
        (paths.logs / "prepare.json").write_bytes(encode(logs))
        failed = next((a for a in logs if not a.ok), None)
        if failed is not None:
            last = failed.attempts[-1]
            raise SandboxError(
                f"prepare action {failed.index} ({failed.action} {failed.target}) failed: "
                f"{last.error or f'exit {last.exit_code}'} {last.stderr[-500:]}".strip()
            )
        harness = self.harnesses.create(spec.agent.harness)
        ctx = harness_context(session, spec, runtime, self.config.proxy_url, paths)
        await harness.install(runtime, ctx)
        await harness.configure(runtime, ctx)
        if not takes_diff(spec):
            return
        baseline = await runtime.exec(baseline_command(), timeout=120)
        if not baseline.ok:  # no git in the image: the session just has no diff
            log.info("no diff baseline for %s: %s", runtime.session_id, baseline.stderr[-300:])

    async def _init_failed(self, item: InitWork, runtime: Runtime | None, exc: Exception) -> None:
        """Retry or end a session whose INIT failed: still INITIALIZING, or already READY
        when its hand-off could not be published (a READY session nobody was told of
        would otherwise be held, and its slot taken, for good). The lease is dropped
        only after the session has moved: a crash in between leaves it to the reaper."""
        transient = is_transient(exc)
        kind = "transient" if transient else "task"
        log.warning("INIT of %s failed (%s): %s", item.session_id, kind, exc)
        await self._stop_own_runtime(item, runtime)
        reason = f"init failed: {exc}"[:2000]
        spec = await self.registry.task_spec(item.task_id)
        session = await self.registry.get_session(item.session_id)
        # only this attempt's: a later one (this holder's lease lapsed) is not this INIT's
        if (
            session is not None
            and session.attempt == item.attempt
            and session.state in (ST.INITIALIZING, ST.READY)
        ):
            if spec and may_retry(session, spec, transient=transient):
                await retry_session(self.registry, self.bus, session, reason)
            else:  # through POSTRUN: its empty ERROR trajectory is delivered
                await fail_before_run(self.registry, self.bus, session, reason, [session.state])
        # not a new holder's, nor this pool's on a later attempt
        await self.registry.release(item.session_id, self.owner, item.attempt)

    async def _init_superseded(self, item: InitWork, why: str) -> None:
        """An INIT cancelled because its session went on without it: its own runtime
        stopped and its own attempt's lease dropped; the session is left as it is (its
        next attempt, maybe on this node, is someone else's business)."""
        log.warning(
            "INIT of %s attempt %d stopped: the session is %s", item.session_id, item.attempt, why
        )
        await self._stop_own_runtime(item, self._runtime_of(item))
        await self.registry.release(item.session_id, self.owner, item.attempt)

    async def _stop_own_runtime(self, item: InitWork, runtime: Runtime | None) -> None:
        """Stop this INIT's runtime (``runtime``: its handle, from ``_runtime_of``)."""
        if runtime is not None:
            with contextlib.suppress(Exception):
                await runtime.cancel()
            return
        if item.session_id not in self.initializing:
            return  # this INIT started no runtime
        # a later attempt's INIT here holds the session's place: this one's, by its id
        spec = await self.registry.task_spec(item.task_id)
        if spec is not None:
            sid = item.session_id
            mine = runtime_id_for(sid, item.attempt)
            with contextlib.suppress(Exception):
                await node_runtime(self.config, spec.runtime, sid, mine).cancel()

    # -- cancellation, leases, heartbeats ---------------------------------------------
    async def subscribe(self) -> list:
        """Core-NATS subscriptions the pool needs (the caller unsubscribes them)."""
        nc = self.bus.nc
        return [
            await nc.subscribe(S.session_cancel("*"), cb=self.on_cancel),
            *[await nc.subscribe(S.session_event(st), cb=self.on_left_ready) for st in LEFT_READY],
            await nc.subscribe(S.session_event(ST.RUNNING), cb=self.on_taken),
        ]

    async def on_taken(self, msg: Msg) -> None:
        """A READY session went RUNNING: room in the READY buffer, maybe."""
        self._ready_left()

    async def on_cancel(self, msg: Msg) -> None:
        """A session cancelled while this pool prepares it: stop its runtime now."""
        sid = msg.subject.rsplit(".", 1)[-1]
        runtime = self.initializing.get(sid)
        if runtime is not None:
            await runtime.cancel()

    async def on_left_ready(self, msg: Msg) -> None:
        """A session of this node left READY for good (cancelled, or ended by the
        deadline check): its prepared runtime waits for nobody, stop it. (If this message
        is missed, the executor stops it on hand-over, and the reaper when the lease the
        pool no longer renews expires.) A run that ended (RUNNING -> POSTRUN) admits
        again when admission waits for a held place: not a tick of the main loop later."""
        try:
            ev = decode(msg.data, SessionStateChanged)
        except ValueError:
            return
        if ev.from_state == ST.RUNNING:  # a run ended: a held place of its node freed
            if self._waits_for_run and ev.node == self.node:
                await self.dispatch()
            return
        if ev.from_state != ST.READY:
            return
        self._ready_left()
        node, raw = await self.registry.redis.hmget(
            S.key_session(ev.session_id), ["node", "runtime_id"]
        )
        spec = await self.registry.task_spec(ev.task_id)
        if node != self.node.encode() or raw is None or spec is None:
            return
        with contextlib.suppress(Exception):
            rt = node_runtime(
                self.config, spec.runtime, ev.session_id, raw.decode(), harness=spec.agent.harness
            )
            await rt.cancel()
        await self.registry.release(ev.session_id)

    async def renew_leases(self) -> None:
        """The pool holds the sessions it prepares, and the READY ones it handed off until
        an executor takes them. A READY session of this node it did not hand off (a dead
        predecessor's, or one whose hand-off was lost) is not renewed: its lease expires
        and a reaper retries or ends it, so no READY session is held forever. A
        preparation its session no longer wants is cancelled (``_stop_unwanted``)."""
        ready = set(await self.registry.node_sessions(self.node, ST.READY))
        self.handed_off &= ready  # taken by an executor, or ended: no longer ours
        held = [*self.initializing, *self.handed_off]
        await self.registry.hold(held, self.owner, self.config.lease_seconds)
        await self._stop_unwanted()

    async def _stop_unwanted(self) -> None:
        """Cancel the preparations whose session went on without them: retried as a later
        attempt (this pool's lease lapsed, or it holds the next attempt too), ended, or
        gone. Read for every preparation, not only for lost leases: a pool back from a cut
        may hold the next attempt itself, and the lease is then still its own. (One
        pipelined read per renewal, of the few sessions preparing: about ``max_init``.)"""
        preparing = list(self._preparing.items())
        if not preparing:
            return
        sessions = await self.registry.get_sessions(sid for (sid, _), _ in preparing)
        for ((_, attempt), prep), now in zip(preparing, sessions, strict=True):
            why = logic.prepared_for_nobody(now, attempt)
            if why is not None and not prep.task.done():  # its INIT logs why it stopped
                prep.unwanted = why
                prep.task.cancel()

    async def heartbeat(self) -> None:
        cfg = self.config
        stages = {
            "QUEUED": len(self.queue),
            **await node_stages(self.registry, self.node, POOL_STAGES),
        }
        beat = NodeHeartbeat(
            ts=time.time(),
            node=self.node,
            service="pool",
            stages=stages,
            capacity={"INIT": cfg.max_init, "READY": cfg.ready_buffer},
        )
        await send_heartbeat(self.bus, self.registry, beat)
