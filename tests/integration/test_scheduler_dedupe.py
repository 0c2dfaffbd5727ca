"""Anonymous task messages (no task_id, no Nats-Msg-Id) published twice: one task,
against real NATS JetStream and Redis/Valkey."""

import asyncio
import uuid

import orjson
import pytest

from schemas import SessionState
from schemas import subjects as S
from services.common.registry import Registry
from services.scheduler.config import SchedulerConfig
from services.scheduler.handlers import Scheduler
from tests.integration.test_scheduler import drain, init_items

pytestmark = pytest.mark.asyncio


def make_scheduler(bus, redis_client, **cfg) -> Scheduler:
    reg = Registry(redis_client, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    return Scheduler(bus, reg, SchedulerConfig(**cfg))


def anonymous(n: int = 3) -> tuple[str, bytes]:
    """A task nothing names, with an instruction no other test uses (to find it)."""
    instruction = f"dedupe {uuid.uuid4().hex}"
    raw = orjson.dumps({"instruction": instruction, "num_samples": n, "agent": {"command": "true"}})
    return instruction, raw


async def tasks_with(reg: Registry, instruction: str) -> list[str]:
    ids = []
    for task_id in await reg.active_tasks():
        task = await reg.get_task(task_id)
        if task is not None and task.spec.instruction == instruction:
            ids.append(task_id)
    return sorted(ids)


async def test_same_anonymous_message_twice_yields_the_sessions_once(bus, redis_client):
    sched = make_scheduler(bus, redis_client)
    instruction, raw = anonymous(4)
    await bus.nc.publish(S.TASKS_SUBMIT, raw)  # `nats pub` ...
    await bus.nc.flush()
    await bus.nc.publish(S.TASKS_SUBMIT, raw)  # ... run twice by mistake
    await bus.js.publish(S.TASKS_SUBMIT, raw)  # and a client's retry through JetStream
    await drain(sched)
    [task_id] = await tasks_with(sched.registry, instruction)
    sessions = await sched.registry.task_sessions(task_id)
    assert len(sessions) == 4 and {s.state for s in sessions} == {SessionState.REGISTERED}
    items = await init_items(bus, task_id)
    assert sorted(i.session_id for i in items) == sorted(s.session_id for s in sessions)


async def test_racing_copies_agree_on_one_task(bus, redis_client):
    sched = make_scheduler(bus, redis_client)
    instruction, raw = anonymous(2)
    await asyncio.gather(*(bus.js.publish(S.TASKS_SUBMIT, raw) for _ in range(12)))
    await drain(sched)  # 8 handlers at once race on the dedupe record
    [task_id] = await tasks_with(sched.registry, instruction)
    assert len(await sched.registry.task_sessions(task_id)) == 2
    assert len(await init_items(bus, task_id)) == 2


async def test_same_message_after_the_window_is_a_new_task(bus, redis_client):
    # the sleep puts the second copy past the window whatever the load; the window is
    # wide, so the third copy (published right after the second) is within it on a
    # loaded machine too (two publishes 1 s apart made a third task there)
    sched = make_scheduler(bus, redis_client, submit_dedupe_seconds=3.0)
    instruction, raw = anonymous(2)
    await bus.js.publish(S.TASKS_SUBMIT, raw)
    await asyncio.sleep(3.3)
    await bus.js.publish(S.TASKS_SUBMIT, raw)  # published after the window: a new task
    await bus.js.publish(S.TASKS_SUBMIT, raw)  # within the window of that one: joins it
    await drain(sched)  # all three handled together: publish times decide, not arrival
    ids = await tasks_with(sched.registry, instruction)
    assert len(ids) == 2
    for task_id in ids:
        assert len(await sched.registry.task_sessions(task_id)) == 2
        assert len(await init_items(bus, task_id)) == 2


async def test_dedupe_can_be_turned_off(bus, redis_client):
    sched = make_scheduler(bus, redis_client, submit_dedupe_seconds=0)
    instruction, raw = anonymous(1)
    await bus.js.publish(S.TASKS_SUBMIT, raw)
    await bus.js.publish(S.TASKS_SUBMIT, raw)
    await drain(sched)
    assert len(await tasks_with(sched.registry, instruction)) == 2
