"""The scheduler's I/O shell: bus messages and HTTP calls -> logic -> registry / bus."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import httpx
from nats.aio.msg import Msg

from proxy.callcount import forget_calls
from schemas import (
    LIVE_STATES,
    CancelTask,
    Session,
    SessionState,
    SessionStateChanged,
    TaskAccepted,
    TaskRejected,
    TaskRequest,
    decode,
    encode,
)
from schemas import subjects as S
from services.common import cancels
from services.common.bus import Bus
from services.common.consumer import Poison
from services.common.finish import CANCELLABLE, fail_before_run
from services.common.finish import cancel_session as finish_cancelled
from services.common.outbox import hand_off_all
from services.common.quarantine import Verdict
from services.common.registry import Outgoing, Registry, TaskRecord
from services.scheduler import logic
from services.scheduler.config import SchedulerConfig
from services.scheduler.plugincheck import PluginCheck

log = logging.getLogger(__name__)
AFTER_RUN = (SessionState.POSTRUN, SessionState.BUILDING, SessionState.EVALUATING)

# Set KEYS[1] to ARGV[2] (expiring in ARGV[3] s) only if it still holds ARGV[1] ('' for
# absent): copies racing in several handlers or replicas agree on one first copy.
_SWAP = """
local v = redis.call('GET', KEYS[1]) or ''
if v ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
return 1
"""


class Scheduler:
    def __init__(self, bus: Bus, registry: Registry, config: SchedulerConfig) -> None:
        self.bus, self.registry, self.config = bus, registry, config
        self.id = uuid.uuid4().hex  # this replica, for claims
        self._swap = registry.redis.register_script(_SWAP)
        self.plugins = PluginCheck()

    # -- submission -----------------------------------------------------------------
    async def parse(self, raw: bytes) -> TaskRequest | logic.Rejection:
        """A submitted task (bus or HTTP), or why it is refused: its fields, and every
        custom plugin it names loaded as its service would load it (``plugincheck``)."""
        parsed = logic.parse_submission(raw, max_bytes=self.config.max_task_bytes)
        if isinstance(parsed, logic.Rejection):
            return parsed
        refused = await self.plugins.refusal(logic.plugin_refs(parsed))
        if refused is not None:
            return logic.Rejection(refused[1], refused[0], parsed.task_id)
        return parsed

    async def on_submit(self, msg: Msg) -> None:
        raw = await self.bus.payload(msg)
        msg_id = (msg.headers or {}).get("Nats-Msg-Id")
        parsed = await self.parse(raw)
        if isinstance(parsed, logic.Rejection):
            await self.reject(raw, parsed)
            return
        fresh = None
        if logic.needs_payload_dedupe(parsed, msg_id):
            fresh = await self.anonymous_task_id(raw, msg)
        result = await self.accept(logic.with_task_id(parsed, msg_id, fresh))
        if isinstance(result, logic.Rejection):
            await self.reject(raw, result)

    async def on_submit_quarantined(self, msg: Msg, verdict: Verdict) -> None:
        """Taking this task killed the scheduler again and again: it is refused."""
        raw = await self.bus.payload(msg)
        why = f"quarantined: the scheduler's process died {verdict.times} taking this task"
        await self.reject(raw, logic.Rejection(why, task_id=logic.named_task_id(raw)))

    async def anonymous_task_id(self, raw: bytes, msg: Msg) -> str:
        """The task id of a message that names none: the first copy's when the same bytes
        were published within ``submit_dedupe_seconds`` of it (a retry, a second
        ``nats pub``), else one of its own."""
        meta = msg.metadata
        published = meta.timestamp.timestamp()
        digest = logic.payload_digest(raw)
        own = logic.FirstCopy(
            logic.message_task_id(digest, meta.sequence.stream, published), published
        )
        window = self.config.submit_dedupe_seconds
        if window <= 0:
            return own.task_id
        key, ttl = S.key_submit_dedupe(digest), logic.dedupe_ttl(window)
        while True:  # retried only when another copy changed the record meanwhile
            stored = await self.registry.redis.get(key)
            chosen = logic.join_first(logic.FirstCopy.parse(stored), own, window)
            if chosen is not own:
                log.info("task message is a copy of task %s: joining it", chosen.task_id)
                return chosen.task_id
            if await self._swap(keys=[key], args=[stored or b"", own.encode(), ttl]):
                return own.task_id

    async def accept(self, task: TaskRequest) -> list[Session] | logic.Rejection:
        created, sessions = await self.registry.create_task(task)
        if created == -1:
            return logic.Rejection(
                f"task_id {task.task_id!r} already exists with a different spec",
                "$.task_id",
                task.task_id,
            )
        # Also on a duplicate: the first attempt may have died before publishing. Through
        # the outbox: with the bus away the task is still accepted (it is registered),
        # and its INIT work goes out once the bus is back.
        now = time.time()
        outs = [
            Outgoing(S.SESSIONS_INIT, encode(logic.init_work(s, now)), logic.init_msg_id(s))
            for s in sessions
            if s.state == SessionState.REGISTERED
        ]
        accepted = TaskAccepted(
            ts=now, task_id=task.task_id, session_ids=[s.session_id for s in sessions]
        )
        outs.append(Outgoing(S.TASKS_ACCEPTED, encode(accepted), f"accepted:{task.task_id}"))
        await hand_off_all(self.registry, self.bus, outs)
        return sessions

    async def reject(self, raw: bytes, rejection: logic.Rejection) -> None:
        log.info("rejected task: %s", rejection.reason)
        event = TaskRejected(
            ts=time.time(),
            reason=rejection.reason,
            field=rejection.field,
            task_id=rejection.task_id,
            payload=raw.decode("utf-8", "replace"),
        )
        await self.bus.publish(S.TASKS_REJECTED, encode(event))

    # -- cancellation ---------------------------------------------------------------
    async def on_cancel(self, msg: Msg) -> None:
        try:
            cancel = decode(msg.data, CancelTask)
        except ValueError as exc:
            raise Poison(f"bad cancel message: {exc}") from None
        await self.cancel_task(cancel.task_id, cancel.reason)

    async def cancel_task(self, task_id: str, reason: str) -> int | None:
        """Cancel every live session of the task; None if there is no such task."""
        if await self.registry.get_task(task_id) is None:
            return None
        cancelled = 0
        for s in await self.registry.task_sessions(task_id):
            if s.state in LIVE_STATES and await self.cancel_session(s.session_id, reason):
                cancelled += 1
        await self.maybe_finish(task_id)
        return cancelled

    async def cancel_session(self, session_id: str, reason: str) -> bool:
        """Cancel a session that has not run yet or is running: it ends through POSTRUN
        with outcome CANCELLED, so it still yields its trajectory and its group is whole.
        One already past its run is left to deliver (it is ending anyway): False; the
        cancel is kept for it (``cancels``), in case its build or evaluation keeps dying."""
        for _ in range(3):  # it may move under us (READY -> RUNNING, a retry): read again
            s = await self.registry.get_session(session_id)
            if s is not None and s.state in AFTER_RUN:
                await cancels.ask(self.registry.redis, session_id, reason)
            if s is None or s.state not in CANCELLABLE:
                return False
            if await finish_cancelled(self.registry, self.bus, s, reason):
                # whoever holds the runtime stops it
                await self.bus.nc.publish(S.session_cancel(session_id), reason.encode())
                return True
        return False

    # -- tracking to the end ----------------------------------------------------------
    async def on_session_event(self, msg: Msg) -> None:
        event = decode(msg.data, SessionStateChanged)
        task, counts = await self.registry.task_and_counts(event.task_id)
        if task is None:
            return
        completed = event.to_state == SessionState.COMPLETED and task.status == "active"
        if completed and logic.should_early_stop(counts, task.spec.early_stop):
            await self._early_stop(event.task_id)
            counts = None  # changed by the stop: read again
        await self.maybe_finish(event.task_id, task, counts)

    async def _early_stop(self, task_id: str) -> None:
        for s in await self.registry.task_sessions(task_id):
            if s.state in LIVE_STATES:
                await self.cancel_session(s.session_id, "early stop: enough usable sessions")

    async def maybe_finish(
        self, task_id: str, task: TaskRecord | None = None, counts: dict[str, int] | None = None
    ) -> bool:
        """Deliver the task's result once all its sessions ended. ``task`` and ``counts``:
        what the caller has just read (each read here otherwise)."""
        task = task or await self.registry.get_task(task_id)
        if task is None:
            return False
        if counts is None:
            counts = await self.registry.task_counts(task_id)
        if not logic.is_finished(counts, task.spec.num_samples):
            return False
        sessions = await self.registry.task_sessions(task_id)
        result = logic.build_result(
            task.spec, sessions, submitted_at=task.submitted_at, now=time.time()
        )
        stored = await self.registry.finish_task(task_id, result.status, encode(result))
        await self.bus.publish(S.task_result(task_id), stored, msg_id=f"result:{task_id}")
        if task.spec.callback_url:
            done = await self.deliver_callback(task_id, task.spec.callback_url, stored)
            if not done:
                return True  # another delivery is under way; reconcile retries if it dies
        keep = self.config.retention.finished_seconds
        ended = await self.registry.retire_task(task_id, keep)
        if keep > 0:
            await forget_calls(self.registry.redis, ended, keep)
        return True

    async def deliver_callback(self, task_id: str, url: str, payload: bytes) -> bool:
        """POST the result with bounded retries, once per task; False if someone else
        is delivering it right now."""
        if await self.registry.callback_status(task_id) in ("done", "failed"):
            return True
        budget = self.config.callback_attempts * (self.config.callback_timeout_seconds + 1) * 2
        if not await self.registry.claim(f"callback:{task_id}", self.id, budget):
            return False
        outcome = await self._post_with_retries(url, payload)
        await self.registry.set_callback_status(task_id, "done" if outcome else "failed")
        if not outcome:
            log.warning("callback for task %s to %s failed", task_id, url)
        return True

    async def _post_with_retries(self, url: str, payload: bytes) -> bool:
        delay = self.config.callback_backoff_seconds
        async with httpx.AsyncClient(timeout=self.config.callback_timeout_seconds) as client:
            for attempt in range(1, self.config.callback_attempts + 1):
                with contextlib.suppress(httpx.HTTPError):
                    r = await client.post(
                        url, content=payload, headers={"content-type": "application/json"}
                    )
                    if r.status_code < 300:
                        return True
                    if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
                        return False  # the receiver refuses it: retrying will not help
                if attempt < self.config.callback_attempts:
                    await asyncio.sleep(delay)
                    delay *= 2
        return False

    async def reconcile(self) -> None:
        """Finish tasks whose last event was missed; end sessions whose deadline passed
        before they ever ran (nobody else holds them)."""
        now = time.time()
        for task_id in await self.registry.active_tasks():
            task, counts = await self.registry.task_and_counts(task_id)
            if task is None:
                continue
            # Only a task past its sessions' deadline with some waiting has any to end:
            # the rest cost one read here, not one per session (1,000 active tasks of a
            # backlog were 10,000 session reads per round).
            if logic.may_have_overdue(task.submitted_at, task.spec, counts, now):
                for s in await self.registry.task_sessions(task_id):
                    if s.state in logic.WAITING and s.deadline < now:
                        # through POSTRUN: the session still yields its empty ERROR trajectory
                        await fail_before_run(
                            self.registry, self.bus, s, "deadline passed before the session ran",
                            [s.state],
                        )  # fmt: skip
                        counts = None
            await self.maybe_finish(task_id, task, counts)
