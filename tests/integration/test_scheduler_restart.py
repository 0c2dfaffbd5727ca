"""kill -9 the scheduler process mid-task: nothing is lost."""

import orjson
import pytest

from schemas import SessionState, TaskResult, decode
from schemas import subjects as S
from services.common.registry import Registry
from tests.helpers.node import wait_until
from tests.helpers.procs import ServiceProcess

pytestmark = pytest.mark.asyncio


async def drive(reg: Registry, sid: str) -> None:
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


async def test_restart_mid_task(nats_url, redis_url, bus, redis_client, state_dir):
    reg = Registry(redis_client, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    cfg = {"nats_url": nats_url, "redis_url": redis_url, "reconcile_interval_seconds": 0.5}
    sched = ServiceProcess("services.scheduler.main:create_app", cfg, state_dir / "logs").start()
    try:
        task = {
            "task_id": "restart-1",
            "instruction": "x",
            "num_samples": 4,
            "agent": {"command": "true"},
        }
        await bus.js.publish(S.TASKS_SUBMIT, orjson.dumps(task))
        await wait_until(lambda: _count(reg, "restart-1", 4), 20, "restart-1 counted")
        sids = await reg.task_session_ids("restart-1")
        await drive(reg, sids[0])

        sched.kill()  # kill -9 mid-task
        await drive(reg, sids[1])  # events published while nobody consumes them
        await drive(reg, sids[2])
        later = {
            "task_id": "restart-2",
            "instruction": "y",
            "num_samples": 2,
            "agent": {"command": "true"},
        }
        await bus.js.publish(S.TASKS_SUBMIT, orjson.dumps(later))  # submitted while down

        results = await bus.nc.subscribe(S.task_result("restart-1"))
        sched.start()
        # a message the server handed to the killed scheduler's last pull request (it had
        # not yet seen the connection drop) comes back once its ack_wait (30 s) runs out
        redelivered = 30 + 15
        await wait_until(lambda: _count(reg, "restart-2", 2), redelivered, "restart-2 counted")
        await drive(reg, sids[3])
        result = decode(await bus.payload(await results.next_msg(timeout=redelivered)), TaskResult)
        assert result.counts == {"COMPLETED": 4} and result.status == "completed"
        assert (await reg.get_task("restart-1")).status == "completed"
    finally:
        sched.stop()


async def _count(reg: Registry, task_id: str, n: int) -> bool:
    return len(await reg.task_session_ids(task_id)) == n
