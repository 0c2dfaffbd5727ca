"""``kill -9`` of a node's runtime pool mid-INIT, and of a whole node, as real processes.

Pool only: the executor's reaper notices the INIT lease the dead pool no longer renews,
stops the half-prepared runtime (processes and directory) and ends the session as ERROR,
or retries it when the task allows; a restarted pool runs the retry, and its start-up
sweep leaves the executor's running sessions alone.

Whole node: a reaper elsewhere (it cannot reach this node's runtimes) ends the sessions;
the node's restarted pool and executor sweep what the dead ones left on the node.
"""

import asyncio
import os
import time

import pytest
import redis.exceptions

from schemas import Outcome, SessionFinished, SessionState, decode
from schemas import subjects as S
from services.common.bus import Bus
from services.common.registry import Registry
from services.node.reaper import Reaper
from services.scheduler import logic
from services.scheduler.config import SchedulerConfig
from services.scheduler.handlers import Scheduler
from tests.helpers.node import dead, leftover_dirs, session_procs, task, wait_until
from tests.helpers.procs import ServiceProcess

pytestmark = pytest.mark.asyncio
ST = SessionState
LEASE = 3.0
POOL, EXECUTOR = "services.pool.main:create_app", "services.executor.main:create_app"


def node_config(nats_url: str, redis_url: str, work, node: str = "node0") -> dict:
    return {
        "nats_url": nats_url,
        "redis_url": redis_url,
        "node": node,
        "work_dir": str(work),
        "lease_seconds": LEASE,
        "heartbeat_seconds": 0.5,
        "max_init": 4,
        "ready_buffer": 2,
        "max_run": 4,
    }


# These runs coordinate with the test through marker files on the node's /tmp, which
# bubblewrap (the default sandbox) hides: they run the trusted way, with none.
TRUSTED = {"backend": "local", "sandbox": "none"}


def slow_once(marks) -> dict:
    """A prepare step that sleeps on a session's first INIT only (a marker on the node)."""
    cmd = f'm={marks}/"$POLAR_SESSION_ID"; [ -e "$m" ] && exit 0; touch "$m"; sleep 30'
    return {**TRUSTED, "prepare": [{"action": "exec", "command": cmd}]}


async def start(target: str, config: dict, logs) -> ServiceProcess:
    return await asyncio.to_thread(ServiceProcess(target, config, logs).start)


class Harness:
    """Scheduler, registry and finished events of one test against real servers."""

    def __init__(self, nats_url: str, redis_url: str) -> None:
        self.nats_url, self.redis_url = nats_url, redis_url
        self.finished: list[SessionFinished] = []
        self.procs: list[ServiceProcess] = []

    async def open(self) -> "Harness":
        self.bus = bus = await Bus.open(self.nats_url, "test")
        self.reg = Registry.from_url(
            self.redis_url, publish=lambda s, p, m: bus.publish(s, p, msg_id=m)
        )
        cfg = SchedulerConfig(nats_url=self.nats_url, redis_url=self.redis_url)
        self.sched = Scheduler(bus, self.reg, cfg)
        await bus.nc.subscribe(S.SESSIONS_FINISHED, cb=self._on_finished)
        return self

    async def _on_finished(self, msg) -> None:
        self.finished.append(decode(await self.bus.payload(msg), SessionFinished))

    async def submit(self, request) -> list[str]:
        return [s.session_id for s in await self.sched.accept(logic.with_task_id(request))]

    async def start(self, target: str, config: dict, logs) -> ServiceProcess:
        proc = await start(target, config, logs)
        self.procs.append(proc)
        return proc

    async def states(self, sids: list[str]) -> list:
        return await self.reg.get_sessions(sids)

    async def wait_state(self, sid: str, state: ST, timeout: float, attempt: int = 0):
        async def reached():
            s = (await self.reg.get_sessions([sid]))[0]
            return s if s.state == state and s.attempt == attempt else None

        return await wait_until(reached, timeout, f"{sid} {state} (attempt {attempt})")

    async def close(self) -> None:
        for p in self.procs:
            p.kill()
        await self.reg.close()
        await self.bus.close()


async def sleeping(sid: str) -> list[int]:
    """The session's processes once its slow step (sh + sleep) is running."""
    pids = session_procs(sid)
    return pids if len(pids) >= 2 else []


async def test_kill_9_pool_mid_init(fresh_servers, tmp_path):
    nats_url, redis_url = fresh_servers
    work, logs, marks = tmp_path / "work", tmp_path / "logs", tmp_path / "marks"
    marks.mkdir()
    cfg = node_config(nats_url, redis_url, work)
    h = await Harness(nats_url, redis_url).open()
    try:
        pool = await h.start(POOL, cfg, logs)
        await h.start(EXECUTOR, cfg, logs)
        # A RUNNING session the pool's death and restart must leave alone.
        wait_go = f"while [ ! -e {marks}/go ]; do sleep 0.1; done; echo ran > out.txt"
        [run_id] = await h.submit(task("pk-run", 1, runtime=TRUSTED, agent={"command": wait_go}))
        await h.wait_state(run_id, ST.RUNNING, 20)
        harness = await wait_until(lambda: min(session_procs(run_id), default=0), 10, "harness")
        slow = slow_once(marks)
        [err_id] = await h.submit(task("pk-err", 1, infra_retries=0, runtime=slow))
        # the task's defaults: a lost holder is the system's fault, retried (issue 17.4)
        [retry_id] = await h.submit(task("pk-retry", 1, runtime=slow, agent={"command": "true"}))
        init_pids = []
        for sid in (err_id, retry_id):
            await h.wait_state(sid, ST.INITIALIZING, 20)
            init_pids += await wait_until(lambda sid=sid: sleeping(sid), 10, f"{sid} preparing")
        assert {f"{err_id}-a0-main", f"{retry_id}-a0-main"} <= set(leftover_dirs(work))

        pool.kill()  # kill -9 mid-INIT: its prepare steps live on, its leases lapse
        killed_at = time.monotonic()
        # never ran: finished as ERROR through POSTRUN, so it still yields a trajectory
        err = await h.wait_state(err_id, ST.POSTRUN, 3 * LEASE)
        assert err.outcome == Outcome.ERROR
        await h.wait_state(retry_id, ST.REGISTERED, 3 * LEASE, attempt=1)
        assert time.monotonic() - killed_at < LEASE + LEASE / 2 + 3  # lease + reaper period
        assert "initializing holder lost" in err.reason
        # The executor's reaper reached the INIT runtimes: nothing of them is left.
        await wait_until(lambda: all(dead(p) for p in init_pids), 20, "prepare steps killed")
        assert not {f"{err_id}-a0-main", f"{retry_id}-a0-main"} & set(leftover_dirs(work))

        # The node's pool comes back: the retry is prepared and run, and its start-up
        # sweep did not touch the RUNNING session of the executor that stayed up.
        await h.start(POOL, cfg, logs)
        await h.wait_state(retry_id, ST.POSTRUN, 20, attempt=1)
        assert not dead(harness) and (await h.states([run_id]))[0].state == ST.RUNNING
        assert f"{run_id}-a0-main" in leftover_dirs(work)
        (marks / "go").touch()
        await wait_until(lambda: len(h.finished) == 3, 20, "both runs to finish")
        assert {f.session_id: (f.outcome, f.attempt) for f in h.finished} == {
            err_id: (Outcome.ERROR, 0),
            run_id: (Outcome.COMPLETED, 0),
            retry_id: (Outcome.COMPLETED, 1),
        }
        await wait_until(lambda: leftover_dirs(work) == [], 20, "every runtime removed")
        assert [p for sid in (run_id, err_id, retry_id) for p in session_procs(sid)] == []
    finally:
        await h.close()


def unreachable(spec, session_id: str, runtime_id: str):
    raise OSError("another host: this node's runtimes are out of reach")


async def test_kill_9_whole_node_then_restart_sweeps(fresh_servers, tmp_path):
    nats_url, redis_url = fresh_servers
    work, logs, marks = tmp_path / "work", tmp_path / "logs", tmp_path / "marks"
    marks.mkdir()
    cfg = node_config(nats_url, redis_url, work)
    h = await Harness(nats_url, redis_url).open()
    try:
        pool = await h.start(POOL, cfg, logs)
        executor = await h.start(EXECUTOR, cfg, logs)
        # without bubblewrap, whose sandbox would die with its executor: the sweep is at stake
        run = task("wn-run", 1, infra_retries=0, runtime=TRUSTED, agent={"command": "sleep 60"})
        [run_id] = await h.submit(run)
        await h.wait_state(run_id, ST.RUNNING, 20)
        [init_id] = await h.submit(task("wn-init", 1, infra_retries=0, runtime=slow_once(marks)))
        await h.wait_state(init_id, ST.INITIALIZING, 20)
        await wait_until(lambda: sleeping(init_id), 10, "INIT preparing")
        await wait_until(lambda: sleeping(run_id), 10, "harness running")
        pids = session_procs(init_id) + session_procs(run_id)

        pool.kill()
        executor.kill()
        killed_at = time.monotonic()
        # Noticed elsewhere: a reaper on another host ends both sessions within the
        # lease time; it cannot stop their runtimes, so they live on here.
        elsewhere = Reaper(h.reg, h.bus, unreachable, keep=lambda sid: False, orphan_after=LEASE)

        async def ended() -> bool:
            await elsewhere.reap()
            rows = await h.states([init_id, run_id])
            return rows[0].state == ST.POSTRUN and rows[1].state == ST.POSTRUN

        await wait_until(ended, 3 * LEASE, "the sessions to be ended elsewhere")
        assert time.monotonic() - killed_at < LEASE + 3
        init, run = await h.states([init_id, run_id])
        assert init.outcome == Outcome.ERROR and "initializing holder lost" in init.reason
        assert run.outcome == Outcome.ERROR and "running holder lost" in run.reason
        assert not any(dead(p) for p in pids)
        assert {f"{init_id}-a0-main", f"{run_id}-a0-main"} <= set(leftover_dirs(work))

        # The node comes back: its start-up sweep stops what the dead services left.
        await h.start(POOL, cfg, logs)
        await h.start(EXECUTOR, cfg, logs)
        await wait_until(lambda: all(dead(p) for p in pids), 10, "leftover processes killed")
        await wait_until(lambda: leftover_dirs(work) == [], 10, "leftover runtimes removed")
        assert session_procs(init_id) + session_procs(run_id) == []
    finally:
        await h.close()


async def test_kill_9_whole_node_restarted_before_anyone_notices(fresh_servers, tmp_path):
    """The dead services' leases may still run when the node is back: its start-up sweep
    leaves those sessions to the restarted services' reapers, which end them and stop
    their runtimes once the leases lapse (the executor's RUNNING one included)."""
    nats_url, redis_url = fresh_servers
    work, logs, marks = tmp_path / "work", tmp_path / "logs", tmp_path / "marks"
    marks.mkdir()
    cfg = node_config(nats_url, redis_url, work)
    h = await Harness(nats_url, redis_url).open()
    try:
        services = [await h.start(POOL, cfg, logs), await h.start(EXECUTOR, cfg, logs)]
        [run_id] = await h.submit(task("wr-run", 1, infra_retries=0, agent={"command": "sleep 60"}))
        await h.wait_state(run_id, ST.RUNNING, 20)
        [init_id] = await h.submit(task("wr-init", 1, infra_retries=0, runtime=slow_once(marks)))
        await wait_until(lambda: sleeping(init_id), 20, "INIT preparing")
        await wait_until(lambda: sleeping(run_id), 10, "harness running")
        pids = session_procs(init_id) + session_procs(run_id)

        for s in services:
            s.kill()
        killed_at = time.monotonic()
        await h.start(POOL, cfg, logs)
        await h.start(EXECUTOR, cfg, logs)
        restarted_at = time.monotonic()

        async def ended() -> bool:
            rows = await h.states([init_id, run_id])
            return rows[0].state == ST.POSTRUN and rows[1].state == ST.POSTRUN

        await wait_until(ended, 3 * LEASE, "the restarted node's reapers to end both")
        # promptly once both hold: the leases lapsed and the reapers are up (counted from
        # the kill, the two restarts ate most of a 7.5 s bound under two test workers)
        assert time.monotonic() - max(killed_at + LEASE, restarted_at) < LEASE / 2 + 3
        await wait_until(lambda: all(dead(p) for p in pids), 20, "their processes killed")
        await wait_until(lambda: leftover_dirs(work) == [], 20, "their runtimes removed")
        # both ERROR: what the run captured, and the INIT's empty capture
        await wait_until(lambda: len(h.finished) == 2, 20, "both finish events")
        assert sorted(f.session_id for f in h.finished) == sorted([init_id, run_id])
    finally:
        await h.close()


async def test_leases_lapsed_while_the_registry_was_down_are_not_reaped(tmp_path, nats_url):
    """A Valkey restart longer than a lease lets every lease lapse with its holder alive.
    The reaper waits one lease period after the registry is back (live holders renew
    within a third of one), then reaps only what nobody renewed. Before: every held
    session was retried at once, and a third such fault ended it ERROR (the chaos
    test's "holder lost (lease expired" sessions)."""
    import signal

    from infra import localservers

    port = localservers.free_port()
    valkey = localservers.start_valkey(port, tmp_path / "valkey")
    url = f"redis://127.0.0.1:{port}/0"
    bus = await Bus.open(nats_url, "test-lease-outage")
    reg = Registry.from_url(url)
    # Over a second (the server's uptime is in whole seconds), and long enough that a
    # loaded machine's stall between Valkey's restart and the unaware reaper's look at its
    # uptime stays under it (2 s failed so under CI's load: that reaper reaped both)
    lease = 8.0
    try:
        _, sessions = await reg.create_task(task("outage", 2))
        live, dead = (s.session_id for s in sessions)
        for sid in (live, dead):
            t = await reg.transition(
                sid, ST.INITIALIZING, node="outage-node", lease=("holder", lease)
            )
            assert t.ok
        reaper = Reaper(reg, bus, lambda *a: None, keep=lambda sid: False, orphan_after=lease)
        await asyncio.sleep(lease + 0.2)  # let the registry's uptime pass one lease
        os.killpg(valkey.pid, signal.SIGKILL)  # down for longer than a lease
        with pytest.raises(redis.exceptions.ConnectionError):
            await reaper.reap()
        await asyncio.sleep(lease + 0.5)
        valkey = localservers.start_valkey(port, tmp_path / "valkey")
        assert set(await reg.expired_leases()) == {live, dead}  # both lapsed meanwhile
        assert await reaper.reap() == 0  # just back: nobody could renew
        unaware = Reaper(reg, bus, lambda *a: None, keep=lambda sid: False, orphan_after=lease)
        assert await unaware.reap() == 0  # one that never saw it down: the server's uptime
        await reg.hold([live], "holder", lease)  # the live holder renews
        await asyncio.sleep(lease + 0.1)
        await reg.hold([live], "holder", lease)
        assert await reaper.reap() == 1  # only the dead holder's session
        got = {s.session_id: s for s in await reg.get_sessions([live, dead])}
        assert got[live].state == ST.INITIALIZING and got[live].attempt == 0
        assert got[dead].state == ST.REGISTERED and got[dead].attempt == 1
    finally:
        await reg.close()
        await bus.close()
        localservers.stop_process(valkey.pid)


async def test_leases_lapsed_while_the_registry_refused_writes_are_not_reaped(
    fresh_servers,
):
    """A Valkey failover with ``min-replicas-to-write`` refuses writes (NOREPLICAS) until
    a replica follows the new primary: 16 s in the multi-host test, longer than a lease.
    No holder can renew meanwhile, so the reaper waits a lease period once writes are
    taken again, as after an outage. Before: it reaped live sessions at once, killing
    their harnesses (exit 143) and ending them ERROR (tests/cluster, full size: 31)."""
    nats_url, redis_url = fresh_servers
    bus = await Bus.open(nats_url, "test-lease-norep")
    reg = Registry.from_url(redis_url)
    # Long enough that a loaded machine's stall between the renewal and the last reap
    # cannot lapse the renewed lease (1 s failed so once).
    lease = 3.0
    try:
        _, (s,) = await reg.create_task(task("norep", 1))
        for st in (ST.INITIALIZING, ST.READY):
            assert (await reg.transition(s.session_id, st, node="n")).ok
        t = await reg.transition(s.session_id, ST.RUNNING, lease=("holder", lease))
        assert t.ok
        reaper = Reaper(reg, bus, lambda *a: None, keep=lambda sid: False, orphan_after=lease)
        await asyncio.sleep(lease + 1.2)  # the server's uptime past a lease
        await reg.redis.config_set("min-replicas-to-write", 1)  # no replica: NOREPLICAS
        try:
            with pytest.raises(redis.exceptions.ResponseError, match="NOREPLICAS"):
                await reaper.reap()  # the lease lapsed, and it cannot be taken
        finally:
            await reg.redis.config_set("min-replicas-to-write", 0)
        assert await reaper.reap() == 0  # before the fix: 1, the live holder's session
        assert await reg.hold([s.session_id], "holder", lease) == []  # it renews
        assert await reaper.reap() == 0
        assert (await reg.get_session(s.session_id)).attempt == 0
    finally:
        await reg.close()
        await bus.close()
