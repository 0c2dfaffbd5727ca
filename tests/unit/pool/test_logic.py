"""The pool's bounds as plain functions: room to start INITs, room to go READY; whether a
preparation is still wanted."""

import pytest

from schemas import Session, SessionState
from services.pool.logic import (
    Limits,
    PriorityQueue,
    held_by_runs,
    prepared_for_nobody,
    ready_room,
    room_to_init,
)

L = Limits(max_init=3, ready_buffer=2, max_run=5)


@pytest.mark.parametrize(
    ("init", "ready", "running", "room"),
    [
        (0, 0, 0, 3),  # empty node: max_init
        (2, 0, 0, 1),  # max_init is the bound
        (3, 0, 0, 0),
        (0, 0, 5, 2),  # every run slot busy: only the buffer's room
        (1, 1, 5, 0),  # buffer taken by one READY + one INIT that will be READY
        (0, 2, 5, 0),  # buffer full
        (0, 2, 4, 1),  # a run slot freed
        (2, 2, 3, 0),  # held = max_run + ready_buffer
        (0, 2, 0, 3),  # a lagging executor: INITs may start, they wait to go READY
    ],
)
def test_room_to_init(init, ready, running, room):
    assert room_to_init(init, ready, running, L) == room


def test_room_to_init_never_negative_even_past_the_bounds():
    assert room_to_init(9, 9, 9, L) == 0


@pytest.mark.parametrize(
    ("init", "ready", "running", "by_runs"),
    [
        (0, 0, 0, False),  # the INIT slots are the bound: an INIT's end makes room
        (3, 0, 0, False),  # INIT slots full, places left
        (0, 2, 5, True),  # every place held, INIT slots free: a run's end makes room
        (2, 2, 3, True),  # held = max_run + ready_buffer
        (1, 1, 4, True),  # one place left, two INIT slots: the places bind first
        (2, 0, 4, False),  # one place and one INIT slot: an INIT's end dispatches anyway
    ],
)
def test_held_by_runs(init, ready, running, by_runs):
    """Whether the end of a run (a place freed, no INIT slot) can admit more now."""
    assert held_by_runs(init, ready, running, L) is by_runs


def test_just_in_time_starts_an_init_only_for_a_free_run_slot():
    jit = Limits(max_init=4, ready_buffer=0, max_run=2)
    assert room_to_init(0, 0, 2, jit) == 0
    assert room_to_init(0, 0, 1, jit) == 1
    assert room_to_init(1, 0, 1, jit) == 0


def test_ready_room_caps_ready_at_the_buffer():
    assert [ready_room(r, L) for r in range(4)] == [2, 1, 0, 0]


def test_ready_room_just_in_time_is_one_hand_over_at_a_time():
    jit = Limits(max_init=4, ready_buffer=0, max_run=2)
    assert [ready_room(r, jit) for r in range(3)] == [1, 0, 0]


def test_limits_are_validated():
    with pytest.raises(ValueError):
        Limits(max_init=0)
    with pytest.raises(ValueError):
        Limits(ready_buffer=-1)


def test_priority_queue_higher_first_fifo_within_a_level():
    q = PriorityQueue()
    for i, prio in enumerate([0, 5, 0, 5, -1, 0]):
        q.push(prio, i)
    assert [q.pop() for _ in range(len(q))] == [1, 3, 0, 2, 5, 4]


@pytest.mark.parametrize(
    ("state", "attempt", "why"),
    [
        (SessionState.INITIALIZING, 0, None),  # it waits for this preparation
        (SessionState.REGISTERED, 1, "at attempt 1"),  # retried, not admitted yet
        (SessionState.INITIALIZING, 1, "at attempt 1"),  # the next attempt, here or elsewhere
        (SessionState.CANCELLED, 0, "CANCELLED"),
        (SessionState.POSTRUN, 0, "POSTRUN"),  # ended by its deadline
    ],
)
def test_a_preparation_is_wanted_only_by_its_initializing_attempt(state, attempt, why):
    session = Session(
        session_id="t-0000", task_id="t", index=0, token="ps_x", state=state, attempt=attempt
    )
    assert prepared_for_nobody(session, 0) == why


def test_a_preparation_of_a_session_gone_is_wanted_by_nobody():
    assert prepared_for_nobody(None, 0) == "gone"
