import os
import subprocess
import sys
import time

import pytest

from infra import devstack
from infra.stackstate import (
    Proc,
    StackState,
    alive,
    group_members,
    read_state,
    remove_state,
    split_alive,
    start_ticks,
    state_path,
    stop_group,
    write_state,
)
from infra.topology import Topology


@pytest.fixture
def spawned():
    """Start real short-lived process groups; kill whatever a test leaves behind."""
    procs: list[subprocess.Popen] = []

    def spawn(script: str) -> subprocess.Popen:
        p = subprocess.Popen(["sh", "-c", script], start_new_session=True)
        procs.append(p)
        return p

    yield spawn
    for p in procs:
        for pid in group_members(p.pid):
            os.kill(pid, 9)
        p.wait(5)


def _proc(name: str, pid: int | None, started: bool = True, ticks: int | None = None) -> Proc:
    ticks = start_ticks(pid) if (pid and ticks is None) else ticks
    return Proc(name=name, pid=pid, start_ticks=ticks, url=f"x://{name}", port=1, started=started)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_state_file_round_trip_and_removal(tmp_path):
    state = StackState(
        state_dir=str(tmp_path),
        created_at=1.0,
        procs=[_proc("nats", None, started=False), _proc("scheduler", os.getpid())],
    )
    write_state(state)
    assert read_state(tmp_path) == state
    assert [p.name for p in state.started()] == ["scheduler"]
    remove_state(tmp_path)
    assert read_state(tmp_path) is None
    remove_state(tmp_path)  # idempotent


def test_a_corrupt_state_file_is_reported(tmp_path):
    state_path(tmp_path).write_text("{not json")
    with pytest.raises(RuntimeError, match="unreadable stack state"):
        read_state(tmp_path)


def test_alive_tells_a_reused_pid_apart():
    me = os.getpid()
    assert alive(me) and alive(me, start_ticks(me))
    assert not alive(me, start_ticks(me) + 1)
    assert not alive(_dead_pid())


def test_split_alive(spawned):
    live = spawned("sleep 30")
    state = StackState(
        state_dir="/x",
        created_at=0,
        procs=[
            _proc("a", live.pid),
            _proc("b", _dead_pid(), ticks=1),
            _proc("reused", None, started=False),
        ],
    )
    up, dead = split_alive(state)
    assert [p.name for p in up] == ["a"] and [p.name for p in dead] == ["b"]


def test_stop_group_stops_the_leader_and_its_children(spawned):
    leader = spawned("sleep 30 & sleep 30 & wait")
    deadline = time.monotonic() + 5
    while len(group_members(leader.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    members = group_members(leader.pid)
    assert len(members) == 3
    assert stop_group(_proc("x", leader.pid), timeout=5)
    assert group_members(leader.pid) == []
    for pid in members:
        assert not alive(pid)


def test_stop_group_escalates_to_sigkill(spawned):
    stubborn = spawned("trap '' TERM; sleep 30 & wait; sleep 30")
    deadline = time.monotonic() + 5  # the trap is set once the shell has forked its sleep
    while len(group_members(stubborn.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(group_members(stubborn.pid)) == 2
    t0 = time.monotonic()
    assert stop_group(_proc("x", stubborn.pid), timeout=0.5)
    assert group_members(stubborn.pid) == [] and time.monotonic() - t0 < 5


def test_stop_group_never_signals_a_reused_pid(spawned):
    other = spawned("sleep 30")
    time.sleep(0.05)
    record = _proc("x", other.pid, ticks=start_ticks(other.pid) - 1)  # "an older process"
    assert not stop_group(record, timeout=0.5)
    assert alive(other.pid)
    assert not stop_group(_proc("gone", _dead_pid(), ticks=1))


def test_up_refuses_a_partly_running_stack(tmp_path, spawned):
    live = spawned("sleep 30")
    write_state(
        StackState(
            state_dir=str(tmp_path),
            created_at=0,
            procs=[
                _proc("nats", live.pid),
                _proc("scheduler", _dead_pid(), ticks=1),
            ],
        )
    )
    with pytest.raises(
        devstack.StackError, match=r"partly down \(scheduler exited; nats still running\)"
    ):
        devstack.up(Topology(state_dir=str(tmp_path)))
    assert alive(live.pid)  # nothing was stopped or started
    assert read_state(tmp_path) is not None


def test_down_stops_started_and_leaves_reused(tmp_path, spawned):
    ours = spawned("sleep 30")
    write_state(
        StackState(
            state_dir=str(tmp_path),
            created_at=0,
            procs=[
                _proc("redis", None, started=False),
                _proc("svc", ours.pid),
                _proc("old", _dead_pid(), ticks=1),
            ],
        )
    )
    report = devstack.down(tmp_path)
    assert report.stopped == ["svc"]
    assert report.already_gone == ["old"] and report.left_running == ["redis"]
    assert not alive(ours.pid) and read_state(tmp_path) is None
    assert devstack.down(tmp_path) == devstack.DownReport()  # nothing left: a no-op
