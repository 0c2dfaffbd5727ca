"""Submitting the trainer's tasks: ``polar.tasks.submit`` on NATS with the task id as the
dedupe id (the path ``polar submit`` takes), the scheduler's rejections of our tasks
collected from ``polar.tasks.rejected``, and cancellation of what is left at the end."""

from __future__ import annotations

import time

import orjson

from schemas import CancelTask, ContractError, TaskRejected, decode, encode
from schemas import subjects as S
from services.common.bus import Bus


class TaskRefused(RuntimeError):
    """The scheduler rejected one of the trainer's tasks (a template it cannot run)."""


class Submitter:
    def __init__(self, bus: Bus, prefix: str) -> None:
        self.bus, self.prefix = bus, prefix
        self.rejected: dict[str, str] = {}
        self._sub = None

    async def start(self) -> Submitter:
        self._sub = await self.bus.nc.subscribe(S.TASKS_REJECTED, cb=self._on_rejected)
        return self

    async def _on_rejected(self, msg) -> None:
        try:
            event = decode(await self.bus.payload(msg), TaskRejected)
        except (ContractError, LookupError):
            return
        if event.task_id and event.task_id.startswith(self.prefix):
            self.rejected[event.task_id] = event.reason

    async def submit(self, task: dict) -> bool:
        """Publish one task; False when the bus had it already (a resubmission after a
        restart: the task exists and its sessions run or ran)."""
        ack = await self.bus.publish(S.TASKS_SUBMIT, orjson.dumps(task), msg_id=task["task_id"])
        return not ack.duplicate

    def check(self) -> None:
        if self.rejected:
            tid, reason = next(iter(self.rejected.items()))
            raise TaskRefused(f"the scheduler rejected task {tid}: {reason}")

    async def cancel(self, task_ids: list[str], reason: str) -> None:
        for tid in task_ids:
            event = CancelTask(ts=time.time(), task_id=tid, reason=reason)
            await self.bus.publish(S.TASKS_CANCEL, encode(event))

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
