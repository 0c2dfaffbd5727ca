"""Reading stored trajectories back from the trajectories stream (no consumer state kept)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime

from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas import ContractError, Trajectory, decode
from schemas import subjects as S
from services.common.bus import Bus


async def read_trajectories(
    bus: Bus,
    task_id: str | None = None,
    *,
    unreadable: list[str] | None = None,
    batch: int = 256,
    timeout: float = 2.0,
) -> AsyncIterator[Trajectory]:
    """Every trajectory stored for ``task_id`` (all tasks if None), in stream order, each
    (session, attempt) once. Reads through an ephemeral consumer that acks nothing; what
    cannot be read is named in ``unreadable`` (stream sequence and why)."""
    subject = S.trajectories(task_id or ">")
    stored = read_stored(
        bus, S.STREAM_TRAJECTORIES, subject, unreadable=unreadable, batch=batch, timeout=timeout
    )
    async for t, _ in stored:
        yield t


async def read_stored(
    bus: Bus,
    stream: str,
    subject: str,
    *,
    since: datetime | None = None,
    unreadable: list[str] | None = None,
    batch: int = 256,
    timeout: float = 2.0,
) -> AsyncIterator[tuple[Trajectory, datetime]]:
    """(trajectory, when it was stored) for each on ``subject`` of ``stream`` stored
    from ``since`` on (all without it), in stream order, each (session, attempt) once."""
    config = ConsumerConfig(
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.BY_START_TIME if since else DeliverPolicy.ALL,
        opt_start_time=since,
        inactive_threshold=60.0,
    )
    sub = await bus.js.pull_subscribe(subject, stream=stream, config=config)
    seen: set[tuple[str, int]] = set()
    try:
        if (await sub.consumer_info()).num_pending == 0:
            return
        while True:
            try:
                msgs = await sub.fetch(batch, timeout=timeout)
            except (TimeoutError, NatsTimeout):
                return
            for msg in msgs:
                t = await _trajectory(bus, msg, unreadable)
                if t is not None and (t.session_id, t.attempt) not in seen:
                    seen.add((t.session_id, t.attempt))
                    yield t, msg.metadata.timestamp
            if msgs and msgs[-1].metadata.num_pending == 0:
                return
    finally:
        await sub.unsubscribe()


async def _trajectory(bus: Bus, msg, unreadable: list[str] | None) -> Trajectory | None:
    try:
        return decode(await bus.payload(msg), Trajectory)
    except (ContractError, LookupError) as exc:  # not a trajectory, or its payload is gone
        if unreadable is not None:
            unreadable.append(f"seq {msg.metadata.sequence.stream}: {exc}")
        return None
