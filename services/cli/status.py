"""``polar status``: services and their health, nodes, stream backlogs, sessions by state,
tasks (every active one, up to ``SHOWN_ACTIVE``, and the ``SHOWN_RECENT`` latest finished).

Each part is gathered on its own: an unreachable server makes its part an error line,
never the whole command fail.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats.errors
from nats.js.errors import NotFoundError

from schemas import NodeHeartbeat, decode
from schemas import subjects as S
from services.cli.connect import Unreachable, open_bus, open_registry
from services.cli.context import Stack
from services.common.bus import STREAMS


class ServiceHealth(msgspec.Struct, kw_only=True):
    name: str
    url: str
    pid: int | None
    status: int | None  # HTTP status of /healthz; None: no answer
    detail: object  # the /healthz body, or why there was none


class NodeRow(msgspec.Struct, kw_only=True):
    node: str
    service: str
    age_seconds: float | None
    stages: dict[str, int] = {}
    capacity: dict[str, int] = {}


class ConsumerRow(msgspec.Struct, kw_only=True):
    name: str
    pending: int  # not yet delivered
    ack_pending: int  # delivered, not yet acknowledged
    redelivered: int


class TaskRow(msgspec.Struct, kw_only=True):
    task_id: str
    status: str  # the registry's: active until the scheduler finishes it
    submitted_at: float
    counts: dict[str, int] = {}  # its sessions by state
    active: bool = True


class StreamRow(msgspec.Struct, kw_only=True):
    name: str
    messages: int | None  # None: the stream does not exist yet
    bytes: int = 0
    consumers: list[ConsumerRow] = []


class StatusReport(msgspec.Struct, kw_only=True):
    nats_url: str
    redis_url: str
    stack_record: str | None  # path of the running stack's record, if any
    services: list[ServiceHealth] = []
    nodes: list[NodeRow] | None = None
    streams: list[StreamRow] | None = None
    sessions: dict[str, int] | None = None
    tasks: list[TaskRow] | None = None  # active first, then the latest finished
    tasks_not_shown: int = 0  # active ones past SHOWN_ACTIVE
    errors: list[str] = []


def service_health(stack: Stack) -> list[ServiceHealth]:
    from infra.devstack import healthz

    rows = []
    for name, url, proc in stack.services():
        status, body = healthz(url)
        rows.append(
            ServiceHealth(
                name=name, url=url, pid=proc.pid if proc else None, status=status, detail=body
            )
        )
    return rows


def node_rows(raw: dict[bytes, bytes], now: float) -> list[NodeRow]:
    rows = []
    for key, value in sorted(raw.items()):
        try:
            hb = decode(value, NodeHeartbeat)
        except ValueError:
            rows.append(NodeRow(node=key.decode(), service="?", age_seconds=None))
            continue
        rows.append(
            NodeRow(
                node=hb.node,
                service=hb.service,
                age_seconds=max(0.0, now - hb.ts),
                stages=dict(hb.stages),
                capacity=dict(hb.capacity),
            )
        )
    return rows


async def stream_rows(js) -> list[StreamRow]:
    rows = []
    for cfg in STREAMS:
        try:
            info = await js.stream_info(cfg.name)
        except NotFoundError:
            rows.append(StreamRow(name=cfg.name, messages=None))
            continue
        consumers = [
            ConsumerRow(
                name=c.name,
                pending=c.num_pending or 0,
                ack_pending=c.num_ack_pending or 0,
                redelivered=c.num_redelivered or 0,
            )
            for c in await js.consumers_info(cfg.name)
        ]
        rows.append(
            StreamRow(
                name=cfg.name,
                messages=info.state.messages,
                bytes=info.state.bytes,
                consumers=sorted(consumers, key=lambda c: c.name),
            )
        )
    return rows


async def _bus_part(report: StatusReport) -> None:
    try:
        bus = await open_bus(report.nats_url)
    except Unreachable as exc:
        report.errors.append(str(exc))
        return
    try:
        report.streams = await stream_rows(bus.js)
    except (nats.errors.Error, TimeoutError) as exc:  # e.g. a server without JetStream
        report.errors.append(f"JetStream at {report.nats_url}: {exc or type(exc).__name__}")
    finally:
        await bus.close()


async def _registry_part(report: StatusReport) -> None:
    try:
        registry = await open_registry(report.redis_url)
    except Unreachable as exc:
        report.errors.append(str(exc))
        return
    try:
        report.sessions = await registry.state_counts()
        report.nodes = node_rows(await registry.redis.hgetall(S.KEY_NODES), time.time())
        report.tasks, report.tasks_not_shown = await task_rows(registry)
    finally:
        await registry.close()


SHOWN_ACTIVE, SHOWN_RECENT = 20, 10


async def task_rows(registry) -> tuple[list[TaskRow], int]:
    """The active tasks (the oldest ``SHOWN_ACTIVE``) and the ``SHOWN_RECENT`` latest
    finished ones, each with its sessions by state; and how many active were left out."""
    active = set(await registry.active_tasks())
    known = await registry.task_ids()
    pipe = registry.redis.pipeline(transaction=False)
    for tid in known:
        pipe.hmget(S.key_task(tid), "status", "submitted_at")
    rows = [
        TaskRow(task_id=tid, status=st.decode(), submitted_at=float(at or 0), active=tid in active)
        for tid, (st, at) in zip(known, await pipe.execute(), strict=True)
        if st is not None  # expired between the scan and the read
    ]
    live = sorted((r for r in rows if r.active), key=lambda r: r.submitted_at)
    done = sorted((r for r in rows if not r.active), key=lambda r: -r.submitted_at)
    shown = live[:SHOWN_ACTIVE] + done[:SHOWN_RECENT]
    for row in shown:
        row.counts = await registry.task_counts(row.task_id)
    return shown, max(0, len(live) - SHOWN_ACTIVE)


async def gather(stack: Stack) -> StatusReport:
    record = str(stack.state_dir / "stack.json") if stack.state else None
    report = StatusReport(nats_url=stack.nats_url, redis_url=stack.redis_url, stack_record=record)
    report.services = await asyncio.to_thread(service_health, stack)
    await asyncio.gather(_bus_part(report), _registry_part(report))
    return report
