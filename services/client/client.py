"""The trainer-side client: scored trajectories from ``polar.trajectories.<task>``.

A durable pull consumer on the trajectories stream with explicit acks. Nothing is acked
until the trainer calls ``commit()``: until then every held item is kept alive with
``in_progress``, and a trainer that dies (or closes without committing) gets the items
again. Claim-checked payloads are fetched from the object store; a trajectory seen twice
(same session and attempt) is handed out once.

    async with TrajectoryClient(nats_url, durable="trainer-1") as client:
        async for group in client.groups():          # all num_samples of one task
            train_on(group.trajectories)
            await group.commit()

Groups never wait forever: a group that got no new member for ``group_timeout`` seconds
(default 900) is settled by ``on_partial``: ``"yield"`` hands it out with
``complete=False`` (the trainer decides), ``"drop"`` commits its members untrained and
counts them in ``client.dropped``. Every session that ends yields a trajectory, even one
that failed before its first model call (an empty ERROR one) or was cancelled (outcome
``cancelled``, with what it captured: by the user or by early stop), so a group is short
only when sessions are still running past the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Literal

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import ObjectNotFoundError

from schemas import ContractError, Trace, Trajectory, decode
from schemas import subjects as S
from services.client import connection
from services.client.groups import GroupBuffer, Key, expected_size
from services.common.bus import Bus, connect
from services.common.tasks import cancel_and_wait

COMMITTED_MEMORY = 100_000  # keys remembered after commit, to drop late duplicates
DEFAULT_GROUP_TIMEOUT = 900.0  # seconds without a new member before a group is settled
Partial = Literal["yield", "drop"]
_UNSET: float = -1.0  # groups(partial_after=...) not given: the client's group_timeout


@dataclass
class Dropped:
    """What ``on_partial="drop"`` committed untrained."""

    groups: int = 0
    trajectories: int = 0


@dataclass
class Delivered:
    trajectory: Trajectory
    msg: Msg
    seq: int
    _client: TrajectoryClient
    committed: bool = False

    @property
    def key(self) -> Key:
        return (self.trajectory.session_id, self.trajectory.attempt)

    async def commit(self) -> None:
        """The trainer has stored what it needs: ack (and wait for the server to confirm)."""
        await self._client._commit([self])


@dataclass
class Group:
    task_id: str
    items: list[Delivered]
    complete: bool = True  # False: handed out after the group timeout, members are missing

    @property
    def trajectories(self) -> list[Trajectory]:
        return [i.trajectory for i in self.items]

    async def commit(self) -> None:
        """Commit every member at once (the group was trained on as a whole)."""
        if self.items:
            await self.items[0]._client._commit(self.items)


class TrajectoryClient:
    def __init__(
        self,
        nats_url: str | None = None,
        *,
        durable: str = "trainer",
        task_ids: Iterable[str] | None = None,
        ack_wait: float = 60.0,
        batch: int = 64,
        max_ack_pending: int = 20_000,
        poll_seconds: float = 1.0,
        group_timeout: float | None = DEFAULT_GROUP_TIMEOUT,
        on_partial: Partial = "yield",
        start: Literal["all", "new"] = "all",
        inactive_threshold: float | None = None,
    ) -> None:
        """``nats_url``: None takes the stack's from the environment (``$POLAR_ENV_FILE``,
        the file ``polar up`` writes, or ``$POLAR_NATS_URL``: ``services.client.connection``).
        ``inactive_threshold``: seconds the durable may go without this or another client
        before the server deletes it (None: kept until ``delete_consumer``).
        ``start``: where a new durable begins: every stored trajectory (``"all"``) or
        only those published after it is created (``"new"``: a trainer that submits its
        own tasks once connected). ``group_timeout``: seconds a group may go without a
        new member before it is settled by ``on_partial`` (``"yield"``: handed out with
        ``complete=False``; ``"drop"``: committed untrained, counted in ``dropped``);
        None waits forever."""
        if on_partial not in ("yield", "drop"):
            raise ValueError(f"on_partial must be 'yield' or 'drop', not {on_partial!r}")
        if group_timeout is not None and group_timeout <= 0:
            raise ValueError(f"group_timeout must be > 0 seconds or None, not {group_timeout}")
        self.group_timeout, self.on_partial, self.start = group_timeout, on_partial, start
        self.dropped = Dropped()
        self.nats_url, self.durable = connection.nats_url(nats_url), durable
        self.inactive_threshold = inactive_threshold
        self.task_ids = list(task_ids) if task_ids else None
        self.ack_wait, self.batch, self.max_ack_pending = ack_wait, batch, max_ack_pending
        self.poll_seconds = poll_seconds
        self.bus: Bus | None = None
        self._sub = None
        self._held: dict[Key, Delivered] = {}
        self._committed: OrderedDict[Key, None] = OrderedDict()
        self._keepalive: asyncio.Task | None = None
        self._groups: GroupBuffer[Delivered] = GroupBuffer()  # survives between groups() calls

    # -- connection ---------------------------------------------------------------------
    def consumer_config(self) -> ConsumerConfig:
        cfg = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.NEW if self.start == "new" else DeliverPolicy.ALL,
            ack_wait=self.ack_wait,
            max_deliver=-1,  # a trajectory is never given up on
            max_ack_pending=self.max_ack_pending,
            inactive_threshold=self.inactive_threshold,
        )
        subjects = [S.trajectories(t) for t in self.task_ids or []]
        if len(subjects) == 1:
            cfg.filter_subject = subjects[0]
        elif subjects:
            cfg.filter_subjects = subjects
        else:
            cfg.filter_subject = S.trajectories(">")
        return cfg

    async def connect(self) -> TrajectoryClient:
        # refused credentials raise CredentialsRefused at once, saying what to do
        nc = await connect(self.nats_url, f"polar-client-{self.durable}")
        self.bus = Bus(nc, nc.jetstream(timeout=10))
        await self.bus.js.add_consumer(S.STREAM_TRAJECTORIES, self.consumer_config())
        self._sub = await self.bus.js.pull_subscribe_bind(self.durable, S.STREAM_TRAJECTORIES)
        self._keepalive = asyncio.create_task(self._keep_alive())
        return self

    async def close(self, *, release: bool = True) -> None:
        """Disconnect. ``release``: nak what is held but not committed, so it is redelivered
        at once (otherwise after ``ack_wait``)."""
        if self._keepalive:
            await cancel_and_wait([self._keepalive])
        if release:
            for item in list(self._held.values()):
                with contextlib.suppress(Exception):
                    await item.msg.nak()
        self._held.clear()
        self._groups = GroupBuffer()
        if self.bus and not self.bus.nc.is_closed:
            await self.bus.nc.close()

    async def __aenter__(self) -> TrajectoryClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def delete_consumer(self) -> None:
        """Forget this durable's position on the server (a trainer that is done for good)."""
        assert self.bus is not None
        await self.bus.js.delete_consumer(S.STREAM_TRAJECTORIES, self.durable)

    async def routing(self, traces: Iterable[Trace]) -> dict[str, bytes]:
        """The MoE routing rows these traces name, by object (``Trace.routing``): what
        ``schemas.routing.routing_array`` and ``collate(..., routing=...)`` read."""
        assert self.bus is not None, "connect() first"
        return await routing_blobs(self.bus, traces)

    # -- iteration ----------------------------------------------------------------------
    async def trajectories(self, *, stop_when_idle: bool = False) -> AsyncIterator[Delivered]:
        """Each trajectory once; call ``commit()`` on it when it is safely stored."""
        async for item in self._deliveries(stop_when_idle):
            if item is not None:
                yield item

    async def groups(
        self,
        num_samples: int | None = None,
        *,
        partial_after: float | None = _UNSET,
        on_partial: Partial | None = None,
        stop_when_idle: bool = False,
    ) -> AsyncIterator[Group]:
        """Whole GRPO groups: all ``num_samples`` trajectories of a task (default: the
        ``num_samples`` the evaluator wrote into each trajectory's metadata).

        A group that got no new member for ``partial_after`` seconds (default: the
        client's ``group_timeout``, 900 s; None: wait forever) is settled by
        ``on_partial`` (default: the client's): ``"yield"`` hands it out incomplete
        (``complete=False``), ``"drop"`` commits its members untrained and counts them in
        ``self.dropped``. Groups still incomplete when ``stop_when_idle`` ends the
        iteration stay buffered for the next call."""
        after = self.group_timeout if partial_after == _UNSET else partial_after
        policy = on_partial or self.on_partial
        buffer = self._groups
        async for item in self._deliveries(stop_when_idle):
            now = time.monotonic()
            if item is not None:
                t = item.trajectory
                size = expected_size(t.metadata, num_samples)
                whole = buffer.add(t.task_id, item.key, item, size, now)
                if whole is not None:
                    yield Group(t.task_id, whole)
            if after is None:
                continue
            for task_id, members in buffer.stale(now, after):
                if policy == "yield":
                    yield Group(task_id, members, complete=False)
                else:
                    await self._commit(members)
                    self.dropped.groups += 1
                    self.dropped.trajectories += len(members)

    async def _deliveries(self, stop_when_idle: bool) -> AsyncIterator[Delivered | None]:
        """New deliveries; ``None`` when a poll found nothing (a tick for timers)."""
        assert self._sub is not None, "call connect() first"
        while True:
            try:
                msgs = await self._sub.fetch(self.batch, timeout=self.poll_seconds)
            except (TimeoutError, NatsTimeout):
                if stop_when_idle:
                    return
                yield None
                continue
            for msg in msgs:
                item = await self._accept(msg)
                if item is not None:
                    yield item

    async def _accept(self, msg: Msg) -> Delivered | None:
        """A new item, or None for a duplicate (acked, or merged into the held one)."""
        try:
            trajectory = decode(await self.bus.payload(msg), Trajectory)
        except (ContractError, LookupError):
            await msg.term()  # not a trajectory, or its claim-checked payload is gone
            return None
        seq = msg.metadata.sequence.stream
        key = (trajectory.session_id, trajectory.attempt)
        held = self._held.get(key)
        if key in self._committed or (held is not None and held.seq != seq):
            await msg.ack()  # the same trajectory published twice
            return None
        if held is not None:  # redelivered while held: ack through the newest delivery
            held.msg = msg
            return None
        item = Delivered(trajectory, msg, seq, self)
        self._held[key] = item
        return item

    async def _commit(self, items: list[Delivered]) -> None:
        todo = [i for i in items if not i.committed]
        acks = [i.msg.ack_sync(timeout=10) for i in todo]  # each confirmed by the server
        results = await asyncio.gather(*acks, return_exceptions=True)
        for item, result in zip(todo, results, strict=True):
            if isinstance(result, BaseException):
                continue
            item.committed = True
            self._held.pop(item.key, None)
            self._committed[item.key] = None
            if len(self._committed) > COMMITTED_MEMORY:
                self._committed.popitem(last=False)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # the rest are committed; commit() again retries only these
            raise failed[0]

    async def _keep_alive(self) -> None:
        period = max(self.ack_wait / 3, 0.2)
        while True:
            await asyncio.sleep(period)
            for item in list(self._held.values()):
                with contextlib.suppress(Exception):
                    await item.msg.in_progress()


async def routing_blobs(bus: Bus, traces: Iterable[Trace]) -> dict[str, bytes]:
    """Each routing object the traces' segments name, read once from the object store."""
    names = {seg.object for t in traces if t.routing for seg in t.routing.segments}
    store = await bus.blobs()
    out: dict[str, bytes] = {}
    for name in sorted(names):
        try:
            out[name] = (await store.get(name)).data or b""
        except ObjectNotFoundError as exc:
            raise LookupError(
                f"routing {name} of a trajectory is not in the object store (expired? see "
                "the retention policy's object limits)"
            ) from exc
    return out
