"""Two attempts of one session on one node (issue 20): a host cut off past its lease comes
back after its session was retried, and the next attempt may be admitted on that same
node while the old attempt's holder is still there. Runtime ids carry the attempt
(``<session>-a<attempt>-<role>``), so the old holder's cleanup stops only its own
runtime (before, both were ``<session>-main``: preparing attempt 1 killed attempt 0's
harness, and attempt 0's end then removed attempt 1's sandbox: "harness could not run:
cannot start 'sh'"). The old attempt's harness itself is stopped once its executor
learns the session went on. Real NATS and Valkey, the local runtime under bubblewrap
where it is installed (``sandbox: auto``)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from functools import partial

import pytest

from schemas import InitWork, Outcome, ReadyWork, SessionFinished, SessionState, decode
from schemas import subjects as S
from services.executor.config import ExecutorConfig
from services.executor.handlers import Executor, RunningSession
from services.node.harnesses import default_registry
from services.node.reaper import STOP, retry_session, sweep_leftovers
from services.node.session import node_runtime
from services.pool import handlers as pool_handlers
from services.runtimes.procs import TAG_RUNTIME, tagged_pids
from tests.helpers.node import dead, leftover_dirs, wait_until
from tests.integration.test_attempt_fence import Delivery
from tests.integration.test_pool_faults import NODE, Ack, close_pool, open_pool, registered
from tests.unit.runtimes.support import settled_leftovers

pytestmark = pytest.mark.asyncio
ST = SessionState
# A prepared sandbox under bubblewrap holds files, not processes (each command's
# namespace dies with it): what attempt 1's harness reads shows its sandbox survived.
PREPARE = [{"action": "exec", "command": "echo prepared > prepared.txt"}]


def executor_of(pool, tmp_path) -> Executor:
    nats_url, redis_url = pool.config.nats_url, pool.config.redis_url
    cfg = ExecutorConfig(
        nats_url=nats_url, redis_url=redis_url, work_dir=str(tmp_path / "work"), node=NODE
    )
    return Executor(pool.bus, pool.registry, cfg, default_registry())


def runtime_procs(runtime_id: str) -> list[int]:
    return [p for p in tagged_pids(TAG_RUNTIME, runtime_id) if not dead(p)]


async def harness_gone(pids: list[int]) -> None:
    """Every one of ``pids`` killed: the run ends once its runtime is told to stop, and
    a killed process that a loaded machine has not yet scheduled to exit is still there."""
    await wait_until(lambda: all(dead(p) for p in pids), 10, "the harness's processes killed")


async def prepared(pool, item: InitWork) -> ReadyWork:
    """``item``'s attempt admitted on this node and prepared: its hand-off."""
    sid = item.session_id
    t = await pool.registry.transition(
        sid, ST.INITIALIZING, expect_attempt=item.attempt, node=NODE,
        lease=(pool.owner, 60),
    )  # fmt: skip
    assert t.ok
    assert await pool._init_once(item, fresh=True) == "ready"
    runtime = pool.initializing.pop(sid)  # the INIT job's end lets go of it
    return ReadyWork(
        ts=time.time(), session_id=sid, task_id=item.task_id, node=NODE,
        runtime_id=runtime.runtime_id, attempt=item.attempt,
    )  # fmt: skip


async def retried(pool, sid: str) -> InitWork:
    """Attempt 0's holder was lost (a reaper elsewhere retried it): attempt 1's INIT."""
    reg = pool.registry
    assert await retry_session(reg, pool.bus, await reg.get_session(sid), "holder lost")
    s = await reg.get_session(sid)
    return InitWork(ts=time.time(), session_id=sid, task_id=s.task_id, priority=0, attempt=1)


def harness_sleep(runtime_id: str) -> int | None:
    """Attempt 0's harness's ``sleep 300``, once it runs (the sandbox has a /tmp of its
    own: the test and the harness share no marker file)."""
    for pid in runtime_procs(runtime_id):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read() == b"sleep\x00300\x00":
                    return pid
        except OSError:
            continue
    return None


async def running(executor: Executor, work: ReadyWork) -> tuple[asyncio.Task, int]:
    """Attempt 0 handed to the executor: its run, and its harness's sleep."""
    run = asyncio.create_task(executor.on_ready(Delivery(work)))
    pid = await wait_until(lambda: harness_sleep(work.runtime_id), 20, "attempt 0's harness")
    return run, pid


async def attempt_zero_running(pool, executor: Executor, task_id: str):
    """A two-attempt session registered, prepared and running its attempt 0 here:
    (session id, its hand-off, its run, its harness's sleep)."""
    item0 = await registered(pool, task_id, **TWO_ATTEMPTS)
    work0 = await prepared(pool, item0)
    run0, sleep0 = await running(executor, work0)
    return item0.session_id, work0, run0, sleep0


# Attempt 0 sleeps (until killed: the shell goes on); each then writes what it found.
HARNESS = (
    '[ "$POLAR_ATTEMPT" = 0 ] && sleep 300; echo "attempt $POLAR_ATTEMPT $(cat prepared.txt)"'
    " > out.txt"
)
TWO_ATTEMPTS = dict(
    runtime={"backend": "local", "prepare": PREPARE},
    agent={"command": HARNESS, "output_files": ["out.txt"]},
)


async def finished_event(sub) -> SessionFinished:
    msg = await sub.next_msg(timeout=30)
    return decode(msg.data, SessionFinished)


async def test_an_old_attempts_end_leaves_the_next_attempts_runtime_here(fresh_servers, tmp_path):
    """(a) Attempt 0 runs here while attempt 1 is admitted and prepared on the same node;
    attempt 0's harness then ends and its executor stops its runtime: attempt 1's
    sandbox is still there, and runs."""
    pool = await open_pool(*fresh_servers, tmp_path)
    executor = executor_of(pool, tmp_path)
    sub = await pool.bus.nc.subscribe(S.SESSIONS_FINISHED)
    try:
        sid, work0, run0, sleep0 = await attempt_zero_running(pool, executor, "two-here")
        work1 = await prepared(pool, await retried(pool, sid))
        assert (work0.runtime_id, work1.runtime_id) == (f"{sid}-a0-main", f"{sid}-a1-main")
        # preparing attempt 1 left attempt 0's harness alone (before: killed by its tag)
        assert sid in executor.running and not run0.done() and not dead(sleep0)
        harness0 = runtime_procs(work0.runtime_id)

        os.kill(sleep0, signal.SIGTERM)  # attempt 0's harness ends: its executor cleans up
        await asyncio.wait_for(run0, 30)
        await harness_gone(harness0)
        # before the fix: attempt 1's directory removed with attempt 0's (one id)
        assert leftover_dirs(tmp_path / "work") == [work1.runtime_id]
        now = await pool.registry.get_session(sid)
        assert (now.state, now.attempt) == (ST.READY, 1)  # attempt 0's finish is fenced

        await executor.on_ready(Delivery(work1))
        done = await finished_event(sub)
        # before the fix: ERROR "harness could not run: cannot start 'sh'"
        assert (done.attempt, done.outcome) == (1, Outcome.COMPLETED), done.reason
        assert done.artifacts.files == {"out.txt": "attempt 1 prepared\n"}
        assert leftover_dirs(tmp_path / "work") == []
    finally:
        await close_pool(pool)


async def test_a_run_whose_session_went_on_is_stopped_at_its_next_renewal(fresh_servers, tmp_path):
    """(c) The executor, back from a cut, renews its leases: a session retried meanwhile
    (attempt 1 taken by node1's pool) is no longer its. Its harness is killed and its
    runtime stopped, without touching the new attempt (before: left running, to make
    calls the proxy refuses, until its agent timeout)."""
    pool = await open_pool(*fresh_servers, tmp_path)
    executor = executor_of(pool, tmp_path)
    try:
        sid, work0, run0, sleep0 = await attempt_zero_running(pool, executor, "went-on")
        reg = pool.registry
        harness_pids = runtime_procs(work0.runtime_id)
        await executor.renew_leases()  # still its own: renewed, left running
        await asyncio.sleep(0.5)
        assert not run0.done() and not executor.running[sid].cancelled.is_set()

        await retried(pool, sid)
        t = await reg.transition(sid, ST.INITIALIZING, node="node1", lease=("pool:node1", 60))
        assert t.ok
        await executor.renew_leases()
        await asyncio.wait_for(run0, 15)  # before the fix: still running (sleep-loop)
        await harness_gone(harness_pids)
        assert leftover_dirs(tmp_path / "work") == [] and executor.running == {}
        now = await reg.get_session(sid)
        assert (now.state, now.attempt, now.node) == (ST.INITIALIZING, 1, "node1")
        assert await reg.redis.hget(S.key_session(sid), "lease_owner") == b"pool:node1"
        assert await reg.redis.zscore(S.KEY_LEASES, sid) is not None
    finally:
        await close_pool(pool)


async def test_a_renewal_leaves_a_run_its_hand_over_has_not_started_yet(fresh_servers, tmp_path):
    """A run is in ``running`` just before its READY -> RUNNING takes the lease: a
    renewal then finds the lease the pool's, not lost to a later attempt, and leaves it."""
    pool = await open_pool(*fresh_servers, tmp_path)
    executor = executor_of(pool, tmp_path)
    try:
        item = await registered(pool, "not-yet", agent={"command": "true"})
        work = await prepared(pool, item)
        rt = node_runtime(executor.config, (await pool.registry.task_spec("not-yet")).runtime,
                          item.session_id, work.runtime_id)  # fmt: skip
        run = RunningSession(item.session_id, 0, rt)
        executor.running[item.session_id] = run
        await executor.renew_leases()
        assert not run.cancelled.is_set()
        await rt.stop()
    finally:
        await close_pool(pool)


async def test_a_later_attempts_hand_off_stops_the_old_run_on_this_executor(
    fresh_servers, tmp_path
):
    """Attempt 1 comes back to this node, and its hand-off reaches the executor still
    running attempt 0 (no renewal in between): the old run is stopped and the new one
    run (before: taken for a duplicate delivery and dropped; attempt 1 stayed READY)."""
    pool = await open_pool(*fresh_servers, tmp_path)
    executor = executor_of(pool, tmp_path)
    sub = await pool.bus.nc.subscribe(S.SESSIONS_FINISHED)
    try:
        sid, work0, run0, sleep0 = await attempt_zero_running(pool, executor, "hand-off")
        harness_pids = runtime_procs(work0.runtime_id)
        work1 = await prepared(pool, await retried(pool, sid))

        await asyncio.wait_for(executor.on_ready(Delivery(work1)), 30)
        assert run0.done()
        await harness_gone(harness_pids)
        done = await finished_event(sub)
        assert (done.attempt, done.outcome) == (1, Outcome.COMPLETED), done.reason
        assert done.artifacts.files == {"out.txt": "attempt 1 prepared\n"}
        assert (await pool.registry.get_session(sid)).state == ST.POSTRUN
        assert leftover_dirs(tmp_path / "work") == [] and executor.running == {}
    finally:
        await close_pool(pool)


async def test_a_stale_init_failing_leaves_the_next_attempt_it_holds_here(fresh_servers, tmp_path):
    """One pool holds two attempts of a session: back from a cut, it admitted attempt 1
    while attempt 0's INIT (a long prepare) still ran. Attempt 0's prepare then fails:
    its cleanup stops its own runtime only, and leaves attempt 1's runtime, its place in
    the pool (renewed) and its lease (before: it cancelled whatever runtime the session
    had in the pool, attempt 1's, and dropped the pool's lease on attempt 1)."""
    pool = await open_pool(*fresh_servers, tmp_path)
    try:
        prepare = [{"action": "exec", "command": "sleep 300"}]
        item0 = await registered(
            pool, "stale-init", runtime={"backend": "local", "prepare": prepare}
        )
        sid, reg = item0.session_id, pool.registry
        t = await reg.transition(sid, ST.INITIALIZING, node=NODE, lease=(pool.owner, 60))
        assert t.ok
        init0 = asyncio.create_task(pool._init(item0, Ack()))
        a0 = f"{sid}-a0-main"
        sleep0 = await wait_until(lambda: harness_sleep(a0), 20, "attempt 0's prepare")

        item1 = await retried(pool, sid)
        t = await reg.transition(sid, ST.INITIALIZING, node=NODE, lease=(pool.owner, 60))
        assert t.ok
        spec = (await reg.task_spec("stale-init")).runtime
        rt1 = node_runtime(pool.config, spec, sid, attempt=item1.attempt)  # its INIT's start
        await rt1.start()
        pool.initializing[sid] = rt1

        os.kill(sleep0, signal.SIGTERM)  # attempt 0's prepare fails
        await asyncio.wait_for(init0, 30)
        assert pool.initializing.get(sid) is rt1 and rt1.state == "running"
        assert leftover_dirs(tmp_path / "work") == [rt1.runtime_id]  # a0's removed
        await wait_until(lambda: runtime_procs(a0) == [], 20, "attempt 0's prepare killed")
        now = await reg.get_session(sid)
        assert (now.state, now.attempt) == (ST.INITIALIZING, 1)
        assert await reg.redis.zscore(S.KEY_LEASES, sid) is not None
        await rt1.stop()
    finally:
        await close_pool(pool)


async def test_the_sweep_stops_an_earlier_attempts_runtime_and_keeps_the_current_one(
    fresh_servers, tmp_path
):
    """(b) A restarted pool or executor sweeps its work dir: it reads each runtime id
    back into session, attempt and role (the session id here holds '-' and what looks
    like an attempt and a role), stops attempt 0's runtime and keeps attempt 1's, which
    this node holds; a name no runtime id has is left alone."""
    pool = await open_pool(*fresh_servers, tmp_path)
    try:
        # no sandbox: its runtimes' background processes outlive their commands
        runtime = {"backend": "local", "sandbox": "none"}
        item0 = await registered(pool, "sw-a1-main", runtime=runtime)
        sid, reg = item0.session_id, pool.registry
        assert sid == "sw-a1-main-0000"
        spec = (await reg.task_spec("sw-a1-main")).runtime
        assert (await reg.transition(sid, ST.INITIALIZING, node=NODE)).ok  # attempt 0
        await retried(pool, sid)
        t = await reg.transition(sid, ST.INITIALIZING, node=NODE, lease=(pool.owner, 60))
        assert t.ok
        runtime_for = partial(node_runtime, pool.config)
        ids = []
        for attempt in (0, 1):  # what a dead pool left of attempt 0, and attempt 1's
            rt = runtime_for(spec, sid, attempt=attempt)
            await rt.start()
            await rt.exec(["sh", "-c", "nohup sleep 400 >/dev/null 2>&1 &"])
            await rt.detach()
            ids.append(rt.runtime_id)
        a0, a1 = ids
        sessions = tmp_path / "work" / "sessions"
        os.mkdir(sessions / f"{sid}-main")  # not a runtime id (made before ids had attempts)
        # a shell's '&' takes a moment to leave its one process behind
        assert len(await settled_leftovers(a0, 1)) == 1
        a1_procs = await settled_leftovers(a1, 1)
        assert len(a1_procs) == 1

        swept = await sweep_leftovers(reg, str(tmp_path / "work"), NODE, runtime_for)
        assert swept == {a0: STOP}
        await wait_until(lambda: runtime_procs(a0) == [], 20, "attempt 0's process killed")
        assert runtime_procs(a1) == a1_procs
        assert leftover_dirs(tmp_path / "work") == sorted([a1, f"{sid}-main"])
        await runtime_for(spec, sid, a1).stop()
    finally:
        await close_pool(pool)


async def admitted(pool, task_id: str, **spec) -> tuple[InitWork, Ack, asyncio.Task]:
    """A one-session task's attempt 0 admitted by the pool: its work, message, INIT job."""
    item, msg = await registered(pool, task_id, **spec), Ack()
    assert await pool._admit(item, msg)
    (job,) = pool._jobs
    return item, msg, job


async def gone_on(pool, sid: str, *, here: bool):
    """Attempt 0's holder was lost and the session retried: attempt 1 admitted by node1's
    pool, or (``here``) by this pool, back from a cut, its runtime started. Returns
    attempt 1's lease holder and its runtime here (None on node1)."""
    reg = pool.registry
    await retried(pool, sid)
    holder = pool.owner if here else "pool:node1"
    t = await reg.transition(
        sid, ST.INITIALIZING, node=NODE if here else "node1", lease=(holder, 60)
    )
    assert t.ok
    if not here:
        return holder, None
    spec = (await reg.task_spec(sid.rsplit("-", 1)[0])).runtime
    rt1 = node_runtime(pool.config, spec, sid, attempt=1)  # what its INIT starts
    await rt1.start()
    pool.initializing[sid] = rt1
    return holder, rt1


async def assert_attempt_one_untouched(pool, sid: str, holder: str, rt1) -> None:
    now = await pool.registry.get_session(sid)
    assert (now.state, now.attempt, now.node) == (ST.INITIALIZING, 1, pool.node if rt1 else "node1")
    assert await pool.registry.redis.hget(S.key_session(sid), "lease_owner") == holder.encode()
    assert await pool.registry.redis.zscore(S.KEY_LEASES, sid) is not None
    assert pool.initializing == ({sid: rt1} if rt1 else {})
    assert rt1 is None or rt1.state == "running"


async def left_behind(pool, runtime_id: str) -> None:
    """What a failing test left running: INIT jobs cancelled, the prepare's sleep killed."""
    for job in list(pool._jobs):
        job.cancel()
    for pid in runtime_procs(runtime_id):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("here", [False, True], ids=["next-on-node1", "next-here"])
async def test_a_preparation_whose_session_went_on_is_stopped_at_the_next_renewal(
    fresh_servers, tmp_path, here
):
    """Attempt 0's INIT prepares (a long prepare step) while its session goes on to
    attempt 1 (its lease lapsed: node1's pool took the session, or this pool itself,
    back from a cut). The next lease renewal stops attempt 0's INIT: its prepare killed,
    its runtime removed, its init work acked, its place in the pool freed; attempt 1's
    lease, and its runtime here, untouched (before: the INIT ran on, holding a runtime,
    until its prepare ended; it only looks at its session as it goes READY)."""
    pool = await open_pool(*fresh_servers, tmp_path, lease=6.0)
    rt1 = None
    prepare = [{"action": "exec", "command": "sleep 300"}]
    item0, msg0, job0 = await admitted(
        pool, "unwanted", runtime={"backend": "local", "prepare": prepare}
    )
    sid = item0.session_id
    a0 = f"{sid}-a0-main"
    try:
        sleep0 = await wait_until(lambda: harness_sleep(a0), 20, "attempt 0's prepare")
        await pool.renew_leases()  # still its session's: renewed, left alone
        await asyncio.sleep(0.3)
        assert not job0.done() and not dead(sleep0)

        holder, rt1 = await gone_on(pool, sid, here=here)
        await pool.renew_leases()
        await asyncio.wait_for(asyncio.shield(job0), pool.config.lease_seconds / 3)
        await wait_until(lambda: runtime_procs(a0) == [], 20, "attempt 0's prepare killed")
        assert msg0.acked and pool._preparing == {} and pool._init_msgs == {}
        assert leftover_dirs(tmp_path / "work") == ([rt1.runtime_id] if rt1 else [])
        await assert_attempt_one_untouched(pool, sid, holder, rt1)
    finally:
        await left_behind(pool, a0)
        if rt1 is not None:
            await rt1.stop()
        await close_pool(pool)


def hung_start(make_runtime):
    """``node_runtime``, whose runtimes' start never ends (an image pull that hangs)."""

    def runtime(*args, **kwargs):
        rt = make_runtime(*args, **kwargs)
        start = rt._start

        async def hangs() -> None:
            await start()
            await asyncio.Event().wait()

        rt._start = hangs
        return rt

    return runtime


async def test_a_runtime_start_that_hangs_is_stopped_once_its_session_went_on(
    fresh_servers, tmp_path, monkeypatch
):
    """A start that never ends holds the runtime's lock, so even a cancel message's
    ``runtime.cancel()`` waits on it: the renewal cancels the start itself, whose
    teardown removes what it had made."""
    monkeypatch.setattr(pool_handlers, "node_runtime", hung_start(pool_handlers.node_runtime))
    pool = await open_pool(*fresh_servers, tmp_path, lease=6.0)
    item0, msg0, job0 = await admitted(pool, "hung", runtime={"backend": "local"})
    sid = item0.session_id
    a0 = f"{sid}-a0-main"
    try:
        work = tmp_path / "work"
        await wait_until(lambda: leftover_dirs(work) == [a0], 20, "attempt 0's start")
        rt0 = pool.initializing[sid]
        assert rt0.state == "starting"

        holder, _ = await gone_on(pool, sid, here=False)
        await pool.renew_leases()
        await asyncio.wait_for(asyncio.shield(job0), pool.config.lease_seconds / 3)
        assert rt0.state == "stopped" and leftover_dirs(work) == []
        assert msg0.acked and pool._preparing == {} and pool._init_msgs == {}
        await assert_attempt_one_untouched(pool, sid, holder, None)
    finally:
        await left_behind(pool, a0)
        await close_pool(pool)
