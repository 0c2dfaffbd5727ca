"""Cancelling a session in INIT, READY and RUNNING through pool + executor: its runtime
is stopped at once, and no process, session directory (or container) is left behind.

Each stage has something running to leave behind: a prepare action still running (INIT),
a background process a prepare action started (it survives the hand-over: READY), the
harness and its children (RUNNING). Local runtime always; the same with the docker
runtime against podman's Docker API when an engine is there.
"""

import asyncio
from pathlib import Path

import pytest

from schemas import Outcome, SessionState
from services.scheduler import logic
from tests.helpers.node import (
    Node,
    containers,
    leftover_dirs,
    session_procs,
    task,
    wait_until,
)
from tests.helpers.requires import DOCKER_HOST, IMAGE, requires_docker

pytestmark = pytest.mark.asyncio
ST = SessionState

BACKENDS = [
    "local",
    pytest.param("docker", marks=requires_docker),
]
CLEAN_SECONDS = 5.0  # a cancelled runtime is gone well within this


def runtime(backend: str, prepare: list[dict], sandbox: str = "auto") -> dict:
    if backend == "docker":
        return {"backend": "docker", "image": IMAGE, "network": "none", "prepare": prepare}
    return {"backend": "local", "sandbox": sandbox, "prepare": prepare}


async def state_of(node: Node, sid: str) -> ST:
    return (await node.registry.get_session(sid)).state


async def left_behind(node: Node, work: Path, sids: list[str]) -> list[str]:
    """What still exists for these sessions: processes, directories, containers (of the
    session's runtime and of a prewarmed eval runtime)."""
    rids = [f"{sid}-{role}" for sid in sids for role in ("main", "eval")]
    procs = [f"pid {p}" for sid in sids for p in session_procs(sid)]
    dirs = [d for d in leftover_dirs(work) if d in rids]
    return procs + dirs + await asyncio.to_thread(containers, rids)


async def gone(node: Node, work: Path, sids: list[str]) -> bool:
    return not await left_behind(node, work, sids)


@pytest.fixture
async def node_of(fresh_servers, tmp_path):
    nodes = []

    async def start(backend: str, **limits) -> Node:
        extra = {"docker_host": DOCKER_HOST} if backend == "docker" else {}
        node = await Node.start(*fresh_servers, tmp_path / "work", **limits, **extra)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        await node.stop()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_cancel_in_init(node_of, tmp_path, backend):
    node = await node_of(backend)
    work = tmp_path / "work"
    prepare = [{"action": "exec", "command": "sleep 300 >/dev/null 2>&1 & sleep 200"}]
    spec = task("cx-init", runtime=runtime(backend, prepare), agent={"command": "true"})
    [s] = await node.scheduler.accept(logic.with_task_id(spec))

    await wait_until(lambda: len(session_procs(s.session_id)) >= 2, 30, "prepare running")
    assert await state_of(node, s.session_id) == ST.INITIALIZING
    assert await node.scheduler.cancel_task("cx-init", "test cancel") == 1

    await wait_until(lambda: gone(node, work, [s.session_id]), CLEAN_SECONDS, "INIT cleanup")
    assert await state_of(node, s.session_id) == ST.POSTRUN  # to yield its trajectory
    await wait_until(lambda: not node.pool.initializing, 15, "the INIT job to end")
    events = [e.to_state for e in await node.events() if e.session_id == s.session_id]
    assert events == [ST.INITIALIZING, ST.POSTRUN]  # never handed over
    assert finished_as_cancelled(node, [s.session_id])


@pytest.mark.parametrize("backend", BACKENDS)
async def test_cancel_in_ready_and_running(node_of, tmp_path, backend):
    node = await node_of(backend, max_init=1, ready_buffer=1, max_run=1)
    work = tmp_path / "work"
    prepare = [{"action": "exec", "command": "nohup sleep 400 >/dev/null 2>&1 &"}]
    harness = {"command": "sleep 500 >/dev/null 2>&1 & sleep 200"}
    # A process a prepare step leaves running outlives its command only without
    # bubblewrap (there each command is a sandbox of its own, gone with it): the case
    # whose clean-up is at stake here.
    spec = task("cx-run", 2, runtime=runtime(backend, prepare, "none"), agent=harness)
    sids = [s.session_id for s in await node.scheduler.accept(logic.with_task_id(spec))]

    async def by_state() -> dict[ST, str]:
        return {await state_of(node, sid): sid for sid in sids}

    states = await wait_until(
        lambda: _both(by_state(), {ST.READY, ST.RUNNING}), 60, "one RUNNING, one READY"
    )
    ready, running = states[ST.READY], states[ST.RUNNING]
    await wait_until(lambda: len(session_procs(running)) >= 3, 10, "the harness tree")
    assert len(session_procs(ready)) >= 1  # the prepare's background process, still alive

    assert await node.scheduler.cancel_session(ready, "cancel in READY")
    await wait_until(lambda: gone(node, work, [ready]), CLEAN_SECONDS, "READY cleanup")
    assert await state_of(node, running) == ST.RUNNING  # the other one is untouched
    assert len(session_procs(running)) >= 3

    assert await node.scheduler.cancel_session(running, "cancel in RUNNING")
    await wait_until(lambda: gone(node, work, [running]), CLEAN_SECONDS, "RUNNING cleanup")
    await wait_until(lambda: not node.executor.running, 20, "the run to end")
    assert [await state_of(node, sid) for sid in sids] == [ST.POSTRUN, ST.POSTRUN]
    assert finished_as_cancelled(node, sids)  # finished by the canceller, not by the executor
    assert await left_behind(node, work, sids) == []


def finished_as_cancelled(node: Node, sids: list[str]) -> bool:
    """Each session finished, as cancelled and with nothing handed over: its
    (empty or partial) trajectory is built from its capture, and no runtime is kept."""
    got = {sid: ev for sid, ev in node.finished.items() if sid in sids}
    return sorted(got) == sorted(sids) and all(
        ev.outcome == Outcome.CANCELLED and ev.eval_runtime_id is None for ev in got.values()
    )


async def _both(states, wanted: set) -> dict | None:
    got = await states
    return got if set(got) == wanted else None


PREWARM = {"name": "session_completed", "runtime": "fresh", "prewarm": True}
BG_PREPARE = [{"action": "exec", "command": "nohup sleep 400 >/dev/null 2>&1 &"}]


async def prewarmed_run(node: Node, work: Path, task_id: str, backend: str, harness: str):
    """One session RUNNING, its evaluator's fresh runtime prewarmed by the executor
    itself (a prepare action left a background process in each runtime)."""
    spec = task(
        task_id, runtime=runtime(backend, BG_PREPARE), agent={"command": harness}, evaluator=PREWARM
    )
    [s] = await node.scheduler.accept(logic.with_task_id(spec))
    sid = s.session_id
    # main: prepare's sleep; eval: prepare's sleep; harness: sh + sleep
    await wait_until(lambda: len(session_procs(sid)) >= 4, 30, "run + prewarm")
    await wait_until(lambda: f"{sid}-a0-eval" in leftover_dirs(work) or backend == "docker", 5)
    assert await state_of(node, sid) == ST.RUNNING
    return sid


@pytest.mark.parametrize("backend", BACKENDS)
async def test_cancel_in_running_stops_the_prewarmed_eval_runtime(node_of, tmp_path, backend):
    node = await node_of(backend)
    work = tmp_path / "work"
    sid = await prewarmed_run(node, work, "cx-prewarm", backend, "sleep 200")
    if backend == "docker":
        assert len(await asyncio.to_thread(containers, [f"{sid}-a0-eval"])) == 1

    assert await node.scheduler.cancel_session(sid, "cancel with a prewarm")
    await wait_until(lambda: gone(node, work, [sid]), CLEAN_SECONDS, "run + prewarm cleanup")
    await wait_until(lambda: not node.executor.running, 20, "the run to end")
    assert await state_of(node, sid) == ST.POSTRUN and finished_as_cancelled(node, [sid])


async def test_finish_that_loses_a_race_stops_the_prewarmed_eval_runtime(node_of, tmp_path):
    """The session ends while the harness is still running, without a cancel message
    reaching the executor (as when a cancel lands just after the harness exited): the
    finish finds it no longer RUNNING and hands nothing over, so both runtimes stop."""
    node = await node_of("local")
    work = tmp_path / "work"
    sid = await prewarmed_run(node, work, "race-prewarm", "local", "sleep 2")
    t = await node.registry.transition(sid, ST.CANCELLED, from_=[ST.RUNNING], reason="raced")
    assert t.ok
    await wait_until(lambda: not node.executor.running, 10, "the run to end")
    assert await left_behind(node, work, [sid]) == []
    assert await state_of(node, sid) == ST.CANCELLED and not node.finished
