"""Runtime pool + harness executor on the local runtime, against real NATS and Valkey."""

import asyncio
import os

import pytest

from schemas import InitWork, Outcome, SessionState, TaskRequest, decode
from schemas import subjects as S
from services.scheduler import logic
from tests.helpers.node import Node

pytestmark = pytest.mark.asyncio
LIMITS = dict(max_init=3, ready_buffer=2, max_run=5)
HIGH_AGENT = {"harness": "shell", "collect_diff": True}


def shell_task(task_id: str, n: int, command: str, **kw) -> TaskRequest:
    raw = {
        "task_id": task_id,
        "instruction": "write the file",
        "num_samples": n,
        "agent": {"harness": "shell", "command": command},
        **kw,
    }
    import orjson

    return decode(orjson.dumps(raw), TaskRequest)


def check_bounds(events, node: str, limits: dict) -> dict[str, int]:
    """Replay the event log in Redis order; return the peak count per stage."""
    state: dict[str, str] = {}
    peak = {"INITIALIZING": 0, "READY": 0, "RUNNING": 0, "HELD": 0}
    for ev in events:
        if ev.node not in (None, node) and ev.to_state != "REGISTERED":
            continue
        state[ev.session_id] = ev.to_state
        counts = {k: sum(1 for v in state.values() if v == k) for k in peak}
        counts["HELD"] = counts["INITIALIZING"] + counts["READY"] + counts["RUNNING"]
        assert counts["INITIALIZING"] <= limits["max_init"], ev
        assert counts["RUNNING"] <= limits["max_run"], ev
        assert counts["READY"] <= limits["ready_buffer"], ev
        assert counts["HELD"] <= limits["max_run"] + limits["ready_buffer"], ev
        peak = {k: max(peak[k], counts[k]) for k in peak}
    return peak


async def test_200_sessions_flow_within_bounds_and_priority(fresh_servers, tmp_path):
    nats_url, redis_url = fresh_servers
    node = await Node.start(nats_url, redis_url, tmp_path / "work", **LIMITS)
    try:
        cmd = 'echo "$POLAR_SESSION_ID" > out.txt; sleep 0.05'
        node.pool.stop()  # queue everything first so priorities decide the order
        await node.tasks[0]
        arrived: list[str] = []  # init work in stream order: what FIFO means

        async def on_init(msg) -> None:
            arrived.append(decode(msg.data, InitWork).session_id)

        await node.bus.nc.subscribe(S.SESSIONS_INIT, cb=on_init)
        low = await node.scheduler.accept(
            logic.with_task_id(shell_task("low", 100, cmd, priority=0))
        )
        high = await node.scheduler.accept(
            logic.with_task_id(
                shell_task("high", 100, cmd, priority=5, agent=HIGH_AGENT | {"command": cmd})
            )
        )
        node.pool._stopping.clear()
        node.tasks[0] = asyncio.create_task(node.pool.run())
        await node.wait_finished(200, timeout=240)

        outcomes = {ev.outcome for ev in node.finished.values()}
        assert outcomes == {Outcome.COMPLETED}
        diff = node.finished[high[0].session_id].artifacts.diff
        assert "out.txt" in diff and high[0].session_id in diff  # the agent's change only
        # session_completed reads no workspace: no baseline, no diff unless asked
        assert node.finished[low[0].session_id].artifacts.diff == ""
        events = await node.events()
        peak = check_bounds(events, "node0", LIMITS)
        assert peak["RUNNING"] == LIMITS["max_run"] and peak["INITIALIZING"] == LIMITS["max_init"]
        inits = [e.session_id for e in events if e.to_state == "INITIALIZING"]
        high_ids = {s.session_id for s in high}
        first_low = min(i for i, sid in enumerate(inits) if sid not in high_ids)
        last_high = max(i for i, sid in enumerate(inits) if sid in high_ids)
        assert last_high < first_low, "a low-priority session started before a high one"
        assert len(arrived) == 200
        for level in (high_ids, {s.session_id for s in low}):  # FIFO within a level
            assert [i for i in inits if i in level] == [i for i in arrived if i in level]
        assert peak["READY"] == LIMITS["ready_buffer"]  # the buffer was used, never exceeded
        for sid in [s.session_id for s in low][:3]:
            st = await node.registry.get_session(sid)
            assert st.state == SessionState.POSTRUN
        assert not os.listdir(tmp_path / "work" / "sessions")  # every runtime stopped
    finally:
        await node.stop()


async def test_failures_end_the_session_never_leave_it_stuck(fresh_servers, tmp_path):
    """A harness that cannot start ends as ERROR (not stuck in RUNNING); a failing
    prepare is retried as the task allows, then ends as ERROR with its reason."""
    from tests.helpers.node import leftover_dirs
    from tests.helpers.node import task as node_task

    nats_url, redis_url = fresh_servers
    node = await Node.start(nats_url, redis_url, tmp_path / "work", **LIMITS)
    try:
        no_binary = node_task("nobin", agent={"command": ["/nonexistent/agent-cli"]})
        bad_prepare = node_task(
            "badprep",
            max_retries=1,
            runtime={
                "backend": "local",
                "prepare": [{"action": "exec", "command": "echo broken >&2; exit 3"}],
            },
            agent={"command": "true"},
        )
        [a] = await node.scheduler.accept(logic.with_task_id(no_binary))
        [b] = await node.scheduler.accept(logic.with_task_id(bad_prepare))
        await node.wait_finished(2, timeout=30)  # the one that never ran is finished too
        ev = node.finished[a.session_id]
        # named either way: bubblewrap's own "execvp ...", or the spawn's error without it
        assert ev.outcome == Outcome.ERROR and "No such file" in ev.reason
        assert "/nonexistent/agent-cli" in ev.reason

        async def errored():
            s = await node.registry.get_session(b.session_id)
            return s if s.state == SessionState.POSTRUN else None  # no builder here

        for _ in range(200):
            if s := await errored():
                break
            await asyncio.sleep(0.05)
        assert s.attempt == 1 and "prepare action 0" in s.reason and "broken" in s.reason
        # it never ran, yet it is finished like a run: its empty ERROR trajectory follows
        assert node.finished[b.session_id].outcome == Outcome.ERROR and s.outcome == "error"
        assert leftover_dirs(tmp_path / "work") == []
    finally:
        await node.stop()


class _BrokenPresets:
    """The executor's harness registry failing before the run's own try (create)."""

    def create(self, name: str):
        raise RuntimeError(f"no preset {name!r} on this executor")


async def test_harness_setup_failure_ends_in_error_with_the_reason(fresh_servers, tmp_path):
    from tests.helpers.node import leftover_dirs
    from tests.helpers.node import task as node_task

    nats_url, redis_url = fresh_servers
    node = await Node.start(nats_url, redis_url, tmp_path / "work", **LIMITS)
    try:
        node.executor.harnesses = _BrokenPresets()
        spec = node_task(
            "nosetup", agent={"command": "true"}, evaluator={"runtime": "fresh", "prewarm": True}
        )
        [s] = await node.scheduler.accept(logic.with_task_id(spec))
        await node.wait_finished(1, timeout=30)
        ev = node.finished[s.session_id]
        assert ev.outcome == Outcome.ERROR and "could not be set up" in ev.reason
        assert "no preset 'shell'" in ev.reason
        assert ev.eval_runtime_id == f"{s.session_id}-a0-eval"  # an errored run is scored too
        st = await node.registry.get_session(s.session_id)
        assert st.state == SessionState.POSTRUN and st.outcome == Outcome.ERROR
        assert s.session_id not in await node.registry.expired_leases(now=1e12)  # released
        # the session's runtime stopped; the prewarmed one is the evaluator's to stop
        assert leftover_dirs(tmp_path / "work") == [f"{s.session_id}-a0-eval"]
    finally:
        await node.stop()


async def test_the_end_of_a_run_admits_the_next_session_at_once(fresh_servers, tmp_path):
    """One held place (max_run 1, no READY buffer): each session waits for the run before
    it to end. The pool hears the run's POSTRUN and admits the next one then, not on its
    main loop's next turn (up to a 1 s fetch later: 0.5 s per session on average)."""
    from tests.helpers.node import wait_until

    nats_url, redis_url = fresh_servers
    limits = dict(max_init=1, ready_buffer=0, max_run=1)
    node = await Node.start(nats_url, redis_url, tmp_path / "work", **limits)
    try:
        sessions = await node.scheduler.accept(
            logic.with_task_id(shell_task("onebyone", 4, "sleep 0.2"))
        )
        # not ``wait_finished``: it dispatches itself every 50 ms
        await wait_until(lambda: len(node.finished) == 4, 60, "4 sessions finished")
        events = await node.events()
        at = {(e.session_id, e.to_state): e.ts for e in events}
        order = sorted(sessions, key=lambda s: at[(s.session_id, "INITIALIZING")])
        gaps = [
            at[(nxt.session_id, "INITIALIZING")] - at[(prev.session_id, "POSTRUN")]
            for prev, nxt in zip(order, order[1:], strict=False)
        ]
        assert all(0 <= gap < 0.3 for gap in gaps), gaps
    finally:
        await node.stop()


async def test_an_init_longer_than_ack_wait_keeps_its_init_work(fresh_servers, tmp_path):
    """The pool keeps the init work of a running INIT in progress (ack_wait follows the
    lease: 1 s here, the prepare takes 2.5 s), so it is not delivered again meanwhile."""
    from tests.helpers.node import task as node_task

    nats_url, redis_url = fresh_servers
    node = await Node.start(nats_url, redis_url, tmp_path / "work", lease_seconds=1.0, **LIMITS)
    try:
        slow = node_task(
            "slowinit",
            runtime={"backend": "local", "prepare": [{"action": "exec", "command": "sleep 2.5"}]},
            agent={"command": "true"},
        )
        [s] = await node.scheduler.accept(logic.with_task_id(slow))
        await node.wait_finished(1, timeout=30)
        assert node.finished[s.session_id].outcome == Outcome.COMPLETED
        info = await node.bus.js.consumer_info(S.STREAM_SESSIONS, S.CONSUMER_POOL_INIT)
        # delivered once (a redelivery counts as another delivery), and acked
        assert info.delivered.consumer_seq == 1 and info.num_ack_pending == 0
    finally:
        await node.stop()
