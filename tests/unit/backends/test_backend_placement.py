"""Rendezvous placement: stable, balanced, and only a removed worker's sessions move."""

from __future__ import annotations

from collections import Counter

from proxy.backends.placement import place, rank

WORKERS = [f"http://127.0.0.1:{p}" for p in (30001, 30002, 30003, 30004)]
SESSIONS = [f"session-{i}" for i in range(2000)]


def test_placement_is_a_pure_function_of_session_and_worker_set():
    first = {s: place(s, WORKERS) for s in SESSIONS}
    assert first == {s: place(s, list(reversed(WORKERS))) for s in SESSIONS}
    assert all(rank(s, WORKERS)[0] == first[s] for s in SESSIONS[:200])


def test_sessions_spread_over_all_workers():
    counts = Counter(place(s, WORKERS) for s in SESSIONS)
    assert set(counts) == set(WORKERS)
    assert min(counts.values()) > 0.8 * len(SESSIONS) / len(WORKERS)


def test_removing_a_worker_moves_only_its_sessions_to_their_next_choice():
    before = {s: place(s, WORKERS) for s in SESSIONS}
    dead = WORKERS[1]
    alive = [w for w in WORKERS if w != dead]
    after = {s: place(s, alive) for s in SESSIONS}
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == dead}
    assert all(after[s] == rank(s, WORKERS)[1] for s in moved)
    # the dead worker's sessions spread over the survivors instead of piling on one
    assert len(Counter(after[s] for s in moved)) == len(alive)


def test_a_returning_worker_gets_back_exactly_its_sessions():
    alive = WORKERS[:2] + WORKERS[3:]
    degraded = {s: place(s, alive) for s in SESSIONS}
    healed = {s: place(s, WORKERS) for s in SESSIONS}
    returned = {s for s in SESSIONS if degraded[s] != healed[s]}
    assert returned == {s for s in SESSIONS if healed[s] == WORKERS[2]}


def test_no_workers_no_placement():
    assert place("s", []) is None and rank("s", []) == []
