"""``polar submit`` / ``polar cancel``: over the bus (NATS + Redis) or the scheduler's HTTP API.

Both clients have one interface: ``submit(tf, follow)`` -> Answer, ``wait(task_id, ...)``
-> TaskResult | None, ``cancel(task_id, reason)`` -> message, ``close()``.

Over the bus the CLI subscribes to the acceptance, rejection and result subjects before
it publishes, so no answer can be missed; the TASKS stream also keeps the result, read
back when the task had already finished (a resubmitted file with its own ``task_id``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import msgspec
from nats.js.errors import NotFoundError

from schemas import (
    CancelTask,
    ContractError,
    TaskAccepted,
    TaskRejected,
    TaskResult,
    decode,
    encode,
)
from schemas import subjects as S
from services.cli import taskfile
from services.cli.connect import Unreachable, open_bus, open_registry
from services.cli.taskfile import Answer, Refused, Submitted
from services.common.bus import Bus
from services.common.registry import Registry

OnCounts = Callable[[dict[str, int]], None]
POLL_SECONDS = 0.3


async def _first(queue: asyncio.Queue, timeout: float):
    try:
        return await asyncio.wait_for(queue.get(), timeout)
    except TimeoutError:
        return None


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


# -- over the bus ---------------------------------------------------------------------
class BusTasks:
    def __init__(self, bus: Bus, redis_url: str, ack_timeout: float = 15.0) -> None:
        self.bus, self.redis_url, self.ack_timeout = bus, redis_url, ack_timeout
        self.answers: asyncio.Queue[Submitted | Refused] = asyncio.Queue()
        self.results: asyncio.Queue = asyncio.Queue()
        self._registry: Registry | None = None
        self._task_id, self._payload = "", b""

    @classmethod
    async def open(cls, nats_url: str, redis_url: str, ack_timeout: float = 15.0) -> BusTasks:
        return cls(await open_bus(nats_url), redis_url, ack_timeout)

    async def close(self) -> None:
        if self._registry is not None:
            await self._registry.close()
        await self.bus.close()

    async def registry(self) -> Registry:
        if self._registry is None:
            self._registry = await open_registry(self.redis_url)
        return self._registry

    async def submit(self, tf: taskfile.TaskFile, follow: bool) -> Answer:
        self._task_id, self._payload = tf.task_id or taskfile.new_task_id(), tf.payload
        await self._subscribe(follow)
        ack = await self.bus.publish(S.TASKS_SUBMIT, tf.payload, msg_id=self._task_id)
        if ack.duplicate:  # deduplicated: the scheduler does not see it again
            return await self._known(tf)
        return await _first(self.answers, self.ack_timeout)

    async def _known(self, tf: taskfile.TaskFile) -> Answer:
        """The answer for a task id the bus has seen lately: the registry's record."""
        registry = await self.registry()
        record = await registry.get_task(self._task_id)
        if record is None:
            return None
        if not taskfile.same_task(tf.payload, self._task_id, record.spec):
            reason = f"task_id {self._task_id!r} already exists with a different spec"
            return Refused(reason, "$.task_id", "registry")
        return Submitted(
            self._task_id, await registry.task_session_ids(self._task_id), duplicate=True
        )

    async def _subscribe(self, follow: bool) -> None:
        nc = self.bus.nc
        await nc.subscribe(S.TASKS_ACCEPTED, cb=self._on_accepted)
        await nc.subscribe(S.TASKS_REJECTED, cb=self._on_rejected)
        if follow:
            await nc.subscribe(S.task_result(self._task_id), cb=self.results.put)
        await nc.flush()

    async def _event(self, msg, tp):
        try:  # someone else's malformed message is not our answer
            return decode(await self.bus.payload(msg), tp)
        except (ContractError, LookupError):
            return None

    async def _on_accepted(self, msg) -> None:
        event = await self._event(msg, TaskAccepted)
        if event is not None and taskfile.is_ours_accepted(event, self._task_id):
            await self.answers.put(Submitted(event.task_id, list(event.session_ids)))

    async def _on_rejected(self, msg) -> None:
        event = await self._event(msg, TaskRejected)
        if event is not None and taskfile.is_ours_rejected(event, self._task_id, self._payload):
            await self.answers.put(Refused(event.reason, event.field, "scheduler"))

    async def stored_result(self, task_id: str) -> TaskResult | None:
        try:
            msg = await self.bus.js.get_last_msg(S.STREAM_TASKS, S.task_result(task_id))
        except NotFoundError:
            return None
        return decode(await self.bus.payload(msg), TaskResult)

    async def wait(
        self, task_id: str, timeout: float | None, on_counts: OnCounts
    ) -> TaskResult | None:
        """Poll the task's counts until its result arrives (None: timed out)."""
        registry, deadline = await self.registry(), _deadline(timeout)
        result = await self.stored_result(task_id)
        while result is None:
            on_counts(await registry.task_counts(task_id))
            msg = await _first(self.results, POLL_SECONDS)
            if msg is not None:
                result = decode(await self.bus.payload(msg), TaskResult)
            elif _past(deadline):
                return None
        on_counts(result.counts)
        return result

    async def cancel(self, task_id: str, reason: str) -> str:
        # the bus says nothing of a task it does not know: the registry does (a cancel of
        # a typo printed "published" and exited 0, issue 38.11), as the HTTP API's 404
        if await (await self.registry()).get_task(task_id) is None:
            raise CancelRefused(f"no task {task_id!r} (`polar status` lists the tasks)")
        event = CancelTask(ts=time.time(), task_id=task_id, reason=reason)
        ack = await self.bus.publish(S.TASKS_CANCEL, encode(event))
        return f"cancel of {task_id} published (stream sequence {ack.seq})"


# -- over HTTP ------------------------------------------------------------------------
class _TaskView(msgspec.Struct):
    """The part of GET /tasks/{id} the CLI reads once the task has finished."""

    result: TaskResult


class CancelRefused(RuntimeError):
    pass


def _error_of(r: httpx.Response) -> tuple[str, str | None]:
    try:
        err = r.json()["error"]
        return err["message"], err.get("field")
    except (ValueError, KeyError, TypeError):
        return r.text[:500] or f"HTTP {r.status_code}", None


class HttpTasks:
    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.AsyncClient(
            base_url=url, timeout=10.0, trust_env=False, headers=headers
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def _call(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            return await self.client.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise Unreachable(f"scheduler at {self.url}: {type(exc).__name__}: {exc}") from None

    async def submit(self, tf: taskfile.TaskFile, follow: bool) -> Answer:
        r = await self._call(
            "POST", "/tasks", content=tf.payload, headers={"content-type": "application/json"}
        )
        if r.status_code != 201:
            reason, where = _error_of(r)
            return Refused(reason, where, f"HTTP {r.status_code}")
        body = r.json()
        return Submitted(body["task_id"], body["session_ids"])

    async def wait(
        self, task_id: str, timeout: float | None, on_counts: OnCounts
    ) -> TaskResult | None:
        deadline = _deadline(timeout)
        while True:
            r = await self._call("GET", f"/tasks/{task_id}")
            if r.status_code != 200:
                raise Unreachable(
                    f"scheduler at {self.url}: GET /tasks/{task_id}: {_error_of(r)[0]}"
                )
            body = r.json()
            on_counts(body["counts"])
            if body["result"] is not None:
                result = decode(r.content, _TaskView).result
                on_counts(result.counts)
                return result
            if _past(deadline):
                return None
            await asyncio.sleep(POLL_SECONDS)

    async def cancel(self, task_id: str, reason: str) -> str:
        r = await self._call("DELETE", f"/tasks/{task_id}")
        if r.status_code != 200:
            raise CancelRefused(_error_of(r)[0])
        n = r.json()["cancelled_sessions"]
        return f"cancelled {n} live session(s) of {task_id}"
