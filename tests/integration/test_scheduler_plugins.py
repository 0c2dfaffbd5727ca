"""Submission refuses a task that names, as a plugin, anything no service would load: on
the bus (a TaskRejected naming the field) and over HTTP (a 400 naming it), before any
session exists (issue 33: ``agent.harness: "os:abort"`` got a 201, then killed the pool at
every restart; ``evaluator.name: "os:abort"`` the evaluator, 9 times)."""

import orjson
import pytest
from litestar.testing import AsyncTestClient

from schemas import TaskRejected, decode
from schemas import subjects as S
from services.common.registry import Registry
from services.scheduler.config import SchedulerConfig
from services.scheduler.handlers import Scheduler
from services.scheduler.main import consumers, create_app

pytestmark = pytest.mark.asyncio

JITTER = "tests.unit.evaluators.plugins:Jitter"
NOT_PLUGINS = [  # (what the task sets, the field named, a piece of the reason)
    ({"agent": {"harness": "os:abort"}}, "$.agent.harness", "not a class"),
    ({"evaluator": {"name": "os:abort"}}, "$.evaluator.name", "not a class"),
    ({"evaluator": {"name": "builtins:print"}}, "$.evaluator.name", "not a class"),
    ({"builder": {"name": "os.path:join"}}, "$.builder.name", "is a function, not a class"),
    ({"agent": {"harness": JITTER}}, "$.agent.harness", "must be a subclass of Harness"),
    ({"evaluator": {"name": "nosuchmod_q:X"}}, "$.evaluator.name", "is not importable"),
    (
        {"evaluator": {"name": "rubric", "config": {"base": {"name": "os:abort"}}}},
        "$.evaluator.config.base.name",
        "not a class",
    ),
]


def task_json(task_id: str, **kw) -> bytes:
    return orjson.dumps(
        {"task_id": task_id, "instruction": "x", "agent": {"harness": "noop"}, **kw}
    )


@pytest.fixture
async def scheduler(bus, redis_client):
    reg = Registry(redis_client, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    return Scheduler(bus, reg, SchedulerConfig())


async def test_on_the_bus_each_is_a_rejection_naming_the_field(bus, scheduler):
    sub = await bus.nc.subscribe(S.TASKS_REJECTED)
    for i, (fields, _, _) in enumerate(NOT_PLUGINS):
        await bus.js.publish(S.TASKS_SUBMIT, task_json(f"plg-bus-{i}", **fields))
    await bus.js.publish(S.TASKS_SUBMIT, task_json("plg-bus-ok", evaluator={"name": JITTER}))
    for c in consumers(scheduler):
        await c.run(drain=True)
    got = {}
    for _ in NOT_PLUGINS:
        r = decode(await bus.payload(await sub.next_msg(timeout=30)), TaskRejected)
        got[r.task_id] = r
    await sub.unsubscribe()
    for i, (_, field, reason) in enumerate(NOT_PLUGINS):
        r = got[f"plg-bus-{i}"]
        assert (r.field, reason in r.reason) == (field, True), r.reason
        assert await scheduler.registry.task_sessions(f"plg-bus-{i}") == []
    assert len(await scheduler.registry.task_sessions("plg-bus-ok")) == 1


async def test_over_http_each_is_a_400_naming_the_field(nats_url, redis_url):
    cfg = SchedulerConfig(nats_url=nats_url, redis_url=redis_url, admin_token="adm-plg")
    async with AsyncTestClient(create_app(cfg)) as client:
        client.headers["authorization"] = "Bearer adm-plg"
        for i, (fields, field, reason) in enumerate(NOT_PLUGINS):
            r = await client.post("/tasks", content=task_json(f"plg-http-{i}", **fields))
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["field"] == field and reason in error["message"], error
            assert (await client.get(f"/tasks/plg-http-{i}")).status_code == 404
        ok = await client.post(
            "/tasks", content=task_json("plg-http-ok", evaluator={"name": JITTER})
        )
        assert ok.status_code == 201, ok.text
