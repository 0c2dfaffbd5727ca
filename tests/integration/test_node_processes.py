"""Pool and executor as real service processes: observability while sessions run, then
``kill -9`` of the executor mid-run.

Sessions of a task without retries end as ERROR (POSTRUN with outcome error, so what
they captured is still built) within about the lease time; sessions of a task that
allows a retry go back to REGISTERED and complete on a restarted executor. The
orphaned harness processes are killed and the runtimes removed by the pool's reaper,
the fresh eval runtimes the dead executor was prewarming included.
"""

import asyncio
import time

import httpx
import pytest

from schemas import NodeHeartbeat, Outcome, SessionFinished, SessionState, decode
from schemas import subjects as S
from services.cli.status import node_rows
from services.common.bus import Bus
from services.common.registry import Registry
from services.scheduler import logic
from services.scheduler.config import SchedulerConfig
from services.scheduler.handlers import Scheduler
from tests.helpers.node import dead, leftover_dirs, session_procs, task, wait_until
from tests.helpers.procs import ServiceProcess
from tests.helpers.prometheus import metric

pytestmark = pytest.mark.asyncio
ST = SessionState
LEASE = 3.0
HARNESS = 'echo "attempt $POLAR_ATTEMPT" > out.txt; [ "$POLAR_ATTEMPT" != 0 ] || sleep 60'


async def start(target: str, config: dict, logs) -> ServiceProcess:
    return await asyncio.to_thread(ServiceProcess(target, config, logs).start)


async def scrape(proc: ServiceProcess) -> str:
    async with httpx.AsyncClient() as c:
        return (await c.get(f"{proc.url}/metrics")).text


async def check_observability(pool, executor, reg: Registry, bus: Bus) -> None:
    """Heartbeats (bus, and the hash ``polar status`` reads) and per-stage metrics."""
    sub = await bus.nc.subscribe(S.NODE_HEARTBEAT)
    beat = decode((await sub.next_msg(timeout=5)).data, NodeHeartbeat)
    await sub.unsubscribe()
    assert beat.node == "node0" and beat.service in ("pool", "executor")

    async def four_running() -> list:
        rows = node_rows(await reg.redis.hgetall(S.KEY_NODES), time.time())
        by = {r.service: r for r in rows}
        ok = by.get("executor") and by["executor"].stages.get("RUNNING") == 4
        return rows if ok else []

    rows = await wait_until(four_running, 10, "a heartbeat with RUNNING=4")
    by = {r.service: r for r in rows}
    assert by["executor"].capacity == {"RUNNING": 4}
    assert by["pool"].capacity == {"INIT": 4, "READY": 2}
    assert set(by["pool"].stages) == {"QUEUED", "INIT", "READY"}
    assert all(r.node == "node0" and r.age_seconds < 5 for r in rows)

    ex, po = await scrape(executor), await scrape(pool)
    assert metric(ex, "polar_node_stage_sessions", node="node0", stage="RUNNING") == 4
    assert metric(ex, "polar_node_stage_capacity", node="node0", stage="RUNNING") == 4
    assert metric(ex, "polar_node_stage_wait_seconds_count", stage="run") == 4
    assert metric(po, "polar_node_stage_wait_seconds_count", stage="init") == 4
    assert metric(po, "polar_node_stage_seconds_count", stage="init") == 4
    assert metric(po, "polar_node_stage_results_total", stage="init", result="ready") == 4


async def test_kill_9_executor_mid_run(fresh_servers, tmp_path):
    nats_url, redis_url = fresh_servers
    work, logs = tmp_path / "work", tmp_path / "logs"
    cfg = {
        "nats_url": nats_url,
        "redis_url": redis_url,
        "work_dir": str(work),
        "lease_seconds": LEASE,
        "heartbeat_seconds": 0.5,
        "max_init": 4,
        "ready_buffer": 2,
        "max_run": 4,
    }
    bus = await Bus.open(nats_url, "test")
    reg = Registry.from_url(redis_url, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    sched = Scheduler(bus, reg, SchedulerConfig(nats_url=nats_url, redis_url=redis_url))
    finished: list[SessionFinished] = []

    async def on_finished(msg) -> None:
        finished.append(decode(await bus.payload(msg), SessionFinished))

    await bus.nc.subscribe(S.SESSIONS_FINISHED, cb=on_finished)
    procs = []
    try:
        pool = await start("services.pool.main:create_app", cfg, logs)
        procs.append(pool)
        executor = await start("services.executor.main:create_app", cfg, logs)
        procs.append(executor)
        prewarm = {"runtime": "fresh", "prewarm": True}  # an eval runtime the reaper must find
        no_retry = task("k9-err", 2, infra_retries=0, agent={"command": HARNESS}, evaluator=prewarm)
        retry = task("k9-retry", 2, max_retries=1, agent={"command": HARNESS})
        err_ids = [s.session_id for s in await sched.accept(logic.with_task_id(no_retry))]
        retry_ids = [s.session_id for s in await sched.accept(logic.with_task_id(retry))]
        sids = err_ids + retry_ids

        async def all_running() -> bool:
            return all(s.state == ST.RUNNING for s in await reg.get_sessions(sids))

        await wait_until(all_running, 30, "4 sessions RUNNING")
        harness_pids = await wait_until(
            lambda: (p := [x for sid in sids for x in session_procs(sid)]) and len(p) >= 8 and p,
            10,
            "4 harnesses (sh + sleep each)",
        )
        await check_observability(pool, executor, reg, bus)
        evals = [f"{sid}-a0-eval" for sid in err_ids]
        await wait_until(lambda: set(evals) <= set(leftover_dirs(work)), 10, "prewarms")

        executor.kill()  # kill -9: no goodbye, leases stop being renewed
        killed_at = time.monotonic()

        async def reaped() -> bool:
            rows = await reg.get_sessions(sids)
            return all(s.state == ST.POSTRUN for s in rows[:2]) and all(
                s.attempt == 1 for s in rows[2:]
            )

        await wait_until(reaped, 3 * LEASE, "the reaper to end or retry every session")
        assert time.monotonic() - killed_at < LEASE + LEASE / 2 + 3  # lease + reaper period
        for s in await reg.get_sessions(err_ids):
            assert s.outcome == Outcome.ERROR and "holder lost" in s.reason
        assert {f.session_id: (f.outcome, f.attempt) for f in finished} == {
            sid: (Outcome.ERROR, 0) for sid in err_ids
        }
        await wait_until(lambda: all(dead(p) for p in harness_pids), 20, "orphans killed")
        assert not [d for d in leftover_dirs(work) if d.startswith("k9-err")]  # eval ones too

        # A new executor on the node runs the retried attempts; stale hand-overs of the
        # first attempt come back to it and are dropped (not run, runtime not stopped).
        procs.append(await start("services.executor.main:create_app", cfg, logs))
        await wait_until(lambda: len(finished) == 4, 30, "retried sessions to finish")
        assert {f.session_id: (f.outcome, f.attempt) for f in finished[2:]} == {
            sid: (Outcome.COMPLETED, 1) for sid in retry_ids
        }
        await wait_until(lambda: leftover_dirs(work) == [], 20, "every runtime removed")
        assert [p for sid in sids for p in session_procs(sid)] == []
    finally:
        for p in procs:
            p.kill()
        await reg.close()
        await bus.close()
