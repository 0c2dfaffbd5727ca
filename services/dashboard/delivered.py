"""The scored trajectories as trainers got them: from ``polar.trajectories.<task>``.

The object store holds each trajectory as the builder made it, before its evaluation: no
reward on it or its traces (a completed session's), which the evaluator sets on the copy
it publishes (``services/evaluator/logic.py``'s ``score``). The stored view shows that
copy. Each is found by its dedupe id (``traj:<session>:<attempt>``, the evaluator's
``trajectory_msg_id``): a task's subject is read once with a headers-only ephemeral
consumer that acknowledges nothing (then only what arrived since), the stream sequence
of each is kept, and a trajectory is one direct read of its message.
"""

from __future__ import annotations

import asyncio
import time

from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from schemas import ContractError, Trajectory, decode
from schemas import subjects as S
from services.common.bus import Bus
from services.evaluator.logic import trajectory_msg_id

MSG_ID = "Nats-Msg-Id"
SKEW_SECONDS = 5.0


def key_of(msg_id: str | None) -> tuple[str, int] | None:
    """(session, attempt) of a scored trajectory's dedupe id (the evaluator's
    ``trajectory_msg_id``); None for any other."""
    head, _, attempt = (msg_id or "").rpartition(":")
    session = head.partition(":")[2]
    if not attempt.isdigit() or trajectory_msg_id(session, int(attempt)) != msg_id:
        return None
    return session, int(attempt)


class Delivered:
    def __init__(self) -> None:
        self.seqs: dict[tuple[str, int], int] = {}  # (session, attempt) -> stream sequence
        self.scanned: dict[str, tuple[int, float]] = {}  # task -> (last seq read, when)
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(
        self, bus: Bus, task_id: str, session_id: str, attempt: int, ended_at: float
    ) -> Trajectory | None:
        """The trajectory delivered for this attempt; None when it was not (yet).
        ``ended_at``: when the session reached its final state (the evaluator delivers
        before that transition): a read of the task's subject after it is final."""
        key = (session_id, attempt)
        if key not in self.seqs:
            async with self._locks.setdefault(task_id, asyncio.Lock()):
                _, read_at = self.scanned.get(task_id, (0, 0.0))
                # a clock a little off between hosts must not hide a delivery
                if key not in self.seqs and read_at <= ended_at + SKEW_SECONDS:
                    await self._scan(bus, task_id)
        seq = self.seqs.get(key)
        if seq is None:
            return None
        try:
            msg = await bus.js.get_msg(S.STREAM_TRAJECTORIES, seq)
            return decode(await bus.payload(msg), Trajectory)
        except (NotFoundError, LookupError, ContractError):
            return None  # aged out of the stream since, or not a trajectory

    async def _scan(self, bus: Bus, task_id: str) -> None:
        """The dedupe ids on the task's subject after the last one read."""
        after, _ = self.scanned.get(task_id, (0, 0.0))
        started = time.time()
        subject = S.trajectories(task_id)
        config = ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=after + 1,
            filter_subject=subject,
            headers_only=True,
            inactive_threshold=60.0,
            mem_storage=True,
        )
        sub = await bus.js.pull_subscribe(subject, stream=S.STREAM_TRAJECTORIES, config=config)
        last, complete = after, False
        try:
            pending = (await sub.consumer_info()).num_pending
            while pending:
                try:
                    msgs = await sub.fetch(256, timeout=2.0)
                except (TimeoutError, NatsTimeout):
                    return  # what was read is kept; the next look reads on from there
                for msg in msgs:
                    last = msg.metadata.sequence.stream
                    if (key := key_of((msg.headers or {}).get(MSG_ID))) is not None:
                        self.seqs[key] = last
                pending = msgs[-1].metadata.num_pending if msgs else 0
            complete = True
        finally:
            self.scanned[task_id] = (last, started if complete else 0.0)
            await sub.unsubscribe()
