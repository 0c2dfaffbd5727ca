"""The scheduler against real NATS JetStream and Redis/Valkey."""

import asyncio
import contextlib

import jsonschema
import orjson
import pytest
from litestar.testing import AsyncTestClient

from schemas import InitWork, SessionState, TaskRejected, TaskResult, decode
from schemas import subjects as S
from services.common.registry import Registry
from services.scheduler.config import SchedulerConfig
from services.scheduler.handlers import Scheduler
from services.scheduler.main import consumers, create_app
from tests.helpers.delivery import deliver
from tests.helpers.http_sink import HttpSink
from tests.unit.scheduler.test_logic import BAD

pytestmark = pytest.mark.asyncio


@pytest.fixture
async def scheduler(bus, redis_client):
    reg = Registry(redis_client, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    cfg = SchedulerConfig(callback_backoff_seconds=0.05, callback_attempts=3)
    yield Scheduler(bus, reg, cfg)


async def drain(sched: Scheduler) -> None:
    for c in consumers(sched):
        await c.run(drain=True)


async def init_items(bus, task_id: str) -> list[InitWork]:
    """Init work items of one task, read without consuming them (the pool's queue)."""
    info = await bus.js.stream_info(S.STREAM_SESSIONS)
    items = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        with contextlib.suppress(Exception):
            msg = await bus.js.get_msg(S.STREAM_SESSIONS, seq)
            if msg.subject == S.SESSIONS_INIT:
                item = decode(msg.data, InitWork)
                if item.task_id == task_id:
                    items.append(item)
    return items


def task_json(task_id: str, n: int = 3, **kw) -> bytes:
    return orjson.dumps(
        {
            "task_id": task_id,
            "instruction": "solve",
            "num_samples": n,
            "agent": {"command": "true"},
            **kw,
        }
    )


async def test_submit_creates_sessions_and_init_work_once(bus, scheduler):
    raw = task_json("sch-once", 5)
    await bus.nc.publish(S.TASKS_SUBMIT, raw)  # core publish, as `nats pub` does
    await bus.js.publish(S.TASKS_SUBMIT, raw)  # and again through JetStream
    await drain(scheduler)
    sessions = await scheduler.registry.task_sessions("sch-once")
    assert len(sessions) == 5
    assert {s.state for s in sessions} == {SessionState.REGISTERED}
    items = await init_items(bus, "sch-once")
    assert sorted(i.session_id for i in items) == sorted(s.session_id for s in sessions)


async def dead_letters(bus) -> int:
    return (await bus.js.stream_info(S.STREAM_DLQ)).state.messages


async def test_bad_messages_are_rejected_and_service_keeps_serving(bus, scheduler):
    dead_before = await dead_letters(bus)
    sub = await bus.nc.subscribe(S.TASKS_REJECTED)
    for raw, _ in BAD:
        await bus.js.publish(S.TASKS_SUBMIT, raw)
    await bus.js.publish(S.TASKS_SUBMIT, task_json("sch-after-bad", 2))
    await drain(scheduler)
    rejections = []
    for _ in BAD:
        msg = await sub.next_msg(timeout=5)
        rejections.append(decode(await bus.payload(msg), TaskRejected))
    await sub.unsubscribe()
    assert len(rejections) == len(BAD) >= 20
    by_payload = {r.payload: r.reason for r in rejections}
    for raw, expected in BAD:
        assert expected in by_payload[raw.decode("utf-8", "replace")]
    assert len(await scheduler.registry.task_sessions("sch-after-bad")) == 2
    assert await dead_letters(bus) == dead_before  # bad tasks are rejections, not poison


async def finish_all(reg: Registry, task_id: str, reward: float = 1.0) -> None:
    """Drive sessions through the pipeline as pool/executor/builder/evaluator would."""
    for s in await reg.task_sessions(task_id):
        for state in ("INITIALIZING", "READY", "RUNNING", "POSTRUN", "BUILDING", "EVALUATING"):
            assert (await reg.transition(s.session_id, SessionState(state))).ok
        assert (await reg.transition(s.session_id, SessionState.COMPLETED, reward=reward)).ok


async def test_task_result_and_callback_with_retry(bus, scheduler):
    async with HttpSink(fail_first=1) as sink:
        await bus.js.publish(S.TASKS_SUBMIT, task_json("sch-result", 3, callback_url=sink.url))
        await drain(scheduler)
        sub = await bus.nc.subscribe(S.task_result("sch-result"))
        await finish_all(scheduler.registry, "sch-result", reward=0.5)
        await drain(scheduler)
        result = decode(await bus.payload(await sub.next_msg(timeout=5)), TaskResult)
        await sub.unsubscribe()
        assert result.status == "completed" and result.counts == {"COMPLETED": 3}
        assert result.mean_reward == 0.5 and len(result.sessions) == 3
        assert sink.requests == 2 and len(sink.bodies) == 1  # one failure, one retry
        assert decode(sink.bodies[0], TaskResult) == result
    task = await scheduler.registry.get_task("sch-result")
    assert task.status == "completed"


async def test_cancel_by_subject_and_early_stop(bus, scheduler, tmp_path):
    """A cancelled session (by the user, or by early stop) ends through POSTRUN with
    outcome cancelled: the builder and evaluator deliver its trajectory, then it is
    CANCELLED and the task's result says why."""
    await bus.js.publish(S.TASKS_SUBMIT, task_json("sch-cancel", 3))
    await bus.js.publish(S.TASKS_SUBMIT, task_json("sch-early", 4, early_stop=2))
    await drain(scheduler)
    reg = scheduler.registry
    cancels = await bus.nc.subscribe("polar.control.cancel.*")
    await bus.js.publish(S.TASKS_CANCEL, b'{"type":"task.cancel","task_id":"sch-cancel"}')
    sessions = await reg.task_sessions("sch-early")
    await finish_all_one(reg, sessions[0].session_id)
    await finish_all_one(reg, sessions[1].session_id)
    await drain(scheduler)
    ended = await reg.task_sessions("sch-cancel")
    assert {(s.state, s.outcome) for s in ended} == {(SessionState.POSTRUN, "cancelled")}
    await deliver(bus, reg, tmp_path)
    await drain(scheduler)
    assert {s.state for s in await reg.task_sessions("sch-cancel")} == {SessionState.CANCELLED}
    got = {(await cancels.next_msg(timeout=2)).subject for _ in range(5)}
    assert {s for s in got if "sch-cancel" in s} == {
        S.session_cancel(f"sch-cancel-000{i}") for i in range(3)
    }
    early = await reg.task_sessions("sch-early")
    assert [s.state for s in early] == ["COMPLETED", "COMPLETED", "CANCELLED", "CANCELLED"]
    assert (await reg.get_task("sch-early")).status == "early_stopped"
    assert (await reg.get_task("sch-cancel")).status == "cancelled"


async def finish_all_one(reg: Registry, sid: str) -> None:
    for state in (
        "INITIALIZING",
        "READY",
        "RUNNING",
        "POSTRUN",
        "BUILDING",
        "EVALUATING",
        "COMPLETED",
    ):
        assert (await reg.transition(sid, SessionState(state), reward=1.0)).ok


async def test_poison_cancel_goes_to_dead_letter(bus, scheduler):
    sub = await bus.nc.subscribe(S.dead_letter(S.STREAM_TASKS))
    await bus.js.publish(S.TASKS_CANCEL, b"not a cancel")
    await drain(scheduler)
    msg = await sub.next_msg(timeout=5)
    assert msg.data == b"not a cancel" and "bad cancel message" in msg.headers["Polar-Reason"]
    await sub.unsubscribe()


def answers_as_documented(doc: dict, path: str, method: str, response) -> None:
    """The answer validates against the schema the OpenAPI document gives its status
    (no key the document does not name): the document and the handlers agree."""
    op = doc["paths"][path][method]
    schema = op["responses"][str(response.status_code)]["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator({**schema, "components": doc["components"]})
    validator.validate(response.json())


async def test_http_api(nats_url, redis_url, monkeypatch, bus, redis_client, tmp_path):
    cfg = SchedulerConfig(nats_url=nats_url, redis_url=redis_url, admin_token="adm-http-api")
    async with AsyncTestClient(create_app(cfg)) as client:
        client.headers["authorization"] = "Bearer adm-http-api"
        doc = (await client.get("/schema/openapi.json")).json()
        r = await client.post("/tasks", content=task_json("sch-http", 2))
        assert r.status_code == 201, r.text
        answers_as_documented(doc, "/tasks", "post", r)
        assert r.json()["session_ids"] == ["sch-http-0000", "sch-http-0001"]
        bad = await client.post("/tasks", content=task_json("sch-http2", 2, surprise=1))
        assert bad.status_code == 400 and bad.json()["error"]["field"] == "$.surprise"
        answers_as_documented(doc, "/tasks", "post", bad)
        conflict = await client.post("/tasks", content=task_json("sch-http", 3))
        assert conflict.status_code == 409
        answers_as_documented(doc, "/tasks", "post", conflict)
        got = await client.get("/tasks/sch-http")
        assert got.json()["counts"] == {"REGISTERED": 2} and got.json()["result"] is None
        answers_as_documented(doc, "/tasks/{task_id}", "get", got)
        s = await client.get("/sessions/sch-http-0001")
        assert s.json()["state"] == "REGISTERED" and "token" not in s.json()
        answers_as_documented(doc, "/sessions/{session_id}", "get", s)
        missing = await client.get("/sessions/nope")
        assert missing.status_code == 404
        answers_as_documented(doc, "/sessions/{session_id}", "get", missing)
        refused = await client.get("/tasks/sch-http", headers={"authorization": "Bearer no"})
        assert refused.status_code == 401
        answers_as_documented(doc, "/tasks/{task_id}", "get", refused)
        d = await client.delete("/tasks/sch-http")
        assert d.json()["cancelled_sessions"] == 2
        answers_as_documented(doc, "/tasks/{task_id}", "delete", d)
        reg = Registry(redis_client, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
        await deliver(bus, reg, tmp_path)  # each cancelled session's trajectory, then final
        for _ in range(300):  # the app's consumer reads the results: 30 s for a loaded CPU
            got = (await client.get("/tasks/sch-http")).json()
            if got["result"]:
                break
            await asyncio.sleep(0.1)
        assert got["status"] == "cancelled" and got["result"]["status"] == "cancelled"
        answers_as_documented(doc, "/tasks/{task_id}", "get", await client.get("/tasks/sch-http"))
        assert (await client.delete("/tasks/nope")).status_code == 404
        assert (await client.get("/healthz")).json()["ok"] is True
        assert b"polar_messages_total" in (await client.get("/metrics")).content
        assert {"/tasks", "/tasks/{task_id}", "/sessions/{session_id}"} <= set(doc["paths"])
        # the API's error shape, the limit named (it was litestar's own: {"status_code":
        # 413, "detail": "Request Entity Too Large"}, issue 33)
        huge = await client.post("/tasks", content=b"{" + b" " * 900 * 1024 + b"}")
        assert huge.status_code == 413, huge.text
        answers_as_documented(doc, "/tasks", "post", huge)
        limit = cfg.max_task_bytes
        assert huge.json() == {"error": {"message": f"the task is larger than the limit of "
                                         f"{limit} bytes (max_task_bytes)", "field": None}}  # fmt: skip
        nowhere = await client.get("/nowhere")
        assert nowhere.status_code == 404 and set(nowhere.json()) == {"error"}


async def test_retry_until_max_deliver_is_dead_lettered(bus):
    from services.common.bus import work_consumer
    from services.common.consumer import Consumer, Retry

    calls = []

    async def never_ready(msg):
        calls.append(msg.data)
        raise Retry(0.05, "dependency not there yet")

    subject = "polar.sessions.test-retry"
    dlq = await bus.nc.subscribe(S.dead_letter(S.STREAM_SESSIONS))
    await bus.js.publish(subject, b"job")
    c = Consumer(
        bus, S.STREAM_SESSIONS, work_consumer("test-retry", subject, max_deliver=3), never_ready
    )
    await asyncio.wait_for(c.run(drain=True), 30)
    msg = await dlq.next_msg(timeout=5)
    assert msg.data == b"job" and "still not ready after 3 tries" in msg.headers["Polar-Reason"]
    assert len(calls) == 3
    await dlq.unsubscribe()


async def test_callback_gives_up_after_bounded_attempts_and_scheduler_keeps_serving(bus, scheduler):
    attempts = scheduler.config.callback_attempts
    async with HttpSink(fail_first=10**6) as sink:  # the receiver always answers 500
        await bus.js.publish(S.TASKS_SUBMIT, task_json("sch-cb-down", 2, callback_url=sink.url))
        await drain(scheduler)
        results = await bus.nc.subscribe(S.task_result("sch-cb-down"))
        await finish_all(scheduler.registry, "sch-cb-down")
        await drain(scheduler)
        assert decode(await bus.payload(await results.next_msg(timeout=5)), TaskResult)
        await results.unsubscribe()
        assert sink.requests == attempts and sink.bodies == []  # bounded: then it gives up
        await scheduler.reconcile()  # a later pass does not try again
        assert sink.requests == attempts
    reg = scheduler.registry
    assert await reg.redis.hget(S.key_task("sch-cb-down"), "callback") == b"failed"
    assert (await reg.get_task("sch-cb-down")).status == "completed"
    assert "sch-cb-down" not in await reg.active_tasks()
    async with HttpSink(status=404) as refusing:  # refused outright: one attempt only
        await bus.js.publish(S.TASKS_SUBMIT, task_json("sch-cb-404", 1, callback_url=refusing.url))
        await drain(scheduler)
        await finish_all(reg, "sch-cb-404")
        await drain(scheduler)
        assert refusing.requests == 1
    await bus.js.publish(S.TASKS_SUBMIT, task_json("sch-cb-after", 2))
    await drain(scheduler)
    assert len(await reg.task_sessions("sch-cb-after")) == 2
