"""The retention policy (services/common/settings.py ``Retention``) on real Valkey and NATS:
a finished task's Redis keys expire, and the stream limits reach the streams."""

import asyncio

import orjson
import pytest

from schemas import subjects as S
from services.common.bus import Bus
from services.common.registry import Registry
from services.common.settings import DAY, OBJECT_STREAM, Retention, StreamLimits
from services.scheduler.config import SchedulerConfig
from services.scheduler.handlers import Scheduler
from tests.integration.test_scheduler import drain, finish_all

pytestmark = pytest.mark.asyncio


def task_keys(task_id: str, session_ids: list[str]) -> list[str]:
    return [
        S.key_task(task_id),
        S.key_task_sessions(task_id),
        S.key_task_counts(task_id),
        *map(S.key_session, session_ids),
        *map(S.key_call_seq, session_ids),
    ]


async def test_a_finished_tasks_keys_expire_and_a_live_ones_do_not(bus, redis_client):
    reg = Registry(redis_client, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    sched = Scheduler(bus, reg, SchedulerConfig(retention=Retention(finished_seconds=1.5)))
    for task_id in ("ret-done", "ret-live"):
        raw = {
            "task_id": task_id,
            "instruction": "x",
            "num_samples": 2,
            "agent": {"command": "true"},
        }
        await bus.js.publish(S.TASKS_SUBMIT, orjson.dumps(raw))
    await drain(sched)
    done = await reg.task_session_ids("ret-done")
    live = await reg.task_session_ids("ret-live")
    for sid in done + live:  # as the proxy numbers a model call
        await redis_client.incr(S.key_call_seq(sid))
    await finish_all(reg, "ret-done")
    await drain(sched)
    assert (await reg.get_task("ret-done")).status == "completed"
    ttls = [await redis_client.pttl(k) for k in task_keys("ret-done", done)]
    assert all(0 < t <= 1500 for t in ttls), ttls
    assert [await redis_client.pttl(k) for k in task_keys("ret-live", live)] == [-1] * 7
    await asyncio.sleep(1.7)
    assert await redis_client.exists(*task_keys("ret-done", done)) == 0
    assert await redis_client.exists(*task_keys("ret-live", live)) == 7
    assert "ret-done" not in await reg.active_tasks()


async def test_zero_keeps_a_finished_tasks_keys(bus, redis_client):
    reg = Registry(redis_client, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    sched = Scheduler(bus, reg, SchedulerConfig(retention=Retention(finished_seconds=0)))
    raw = {"task_id": "ret-keep", "instruction": "x", "agent": {"command": "true"}}
    await bus.js.publish(S.TASKS_SUBMIT, orjson.dumps(raw))
    await drain(sched)
    await finish_all(reg, "ret-keep")
    await drain(sched)
    sids = await reg.task_session_ids("ret-keep")
    keys = task_keys("ret-keep", sids)[:-1]  # no model call: no call number
    assert (await reg.get_task("ret-keep")).status == "completed"
    assert [await redis_client.pttl(k) for k in keys] == [-1] * len(keys)


async def stream_limits(bus: Bus, name: str) -> tuple[float, int]:
    cfg = (await bus.js.stream_info(name)).config
    return cfg.max_age or 0.0, cfg.max_bytes


async def test_the_retention_settings_reach_the_streams(fresh_servers):
    nats_url, _ = fresh_servers
    bus = await Bus.open(nats_url, "ret-default")  # the stated default policy
    try:
        assert await stream_limits(bus, S.STREAM_EVENTS) == (3 * DAY, -1)
        assert await stream_limits(bus, S.STREAM_TRAJECTORIES) == (14 * DAY, -1)
        assert await stream_limits(bus, OBJECT_STREAM) == (14 * DAY, 4 << 30)
        assert await stream_limits(bus, S.STREAM_SESSIONS) == (0.0, -1)  # a work queue
    finally:
        await bus.close()
    policy = Retention(
        streams={
            S.STREAM_EVENTS: StreamLimits(max_age_seconds=3600, max_bytes=1 << 20),
            OBJECT_STREAM: StreamLimits(max_age_seconds=600, max_bytes=2 << 20),
        }
    )
    bus = await Bus.open(nats_url, "ret-custom", retention=policy)  # existing streams updated
    try:
        assert await stream_limits(bus, S.STREAM_EVENTS) == (3600.0, 1 << 20)
        assert await stream_limits(bus, OBJECT_STREAM) == (600.0, 2 << 20)
        assert await stream_limits(bus, S.STREAM_COMPLETIONS) == (7 * DAY, -1)  # default
        # a full object store refuses a new object rather than dropping an unread one
        store = await bus.js.object_store(S.OBJECT_STORE)
        with pytest.raises(Exception) as full:  # noqa: B017 - its message is checked
            await store.put("too-big", b"x" * (3 << 20))
        assert "maximum bytes" in str(full.value).lower(), repr(full.value)
    finally:
        await bus.close()
