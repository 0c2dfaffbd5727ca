import asyncio

import pytest

from schemas import SessionState, TaskRequest, decode_event
from schemas import subjects as S
from services.common.registry import Registry

pytestmark = pytest.mark.asyncio


def task(task_id: str, n: int = 3, **kw) -> TaskRequest:
    return TaskRequest(task_id=task_id, instruction="do it", num_samples=n, **kw)


async def test_create_task_is_idempotent(redis_client):
    reg = Registry(redis_client)
    created, sessions = await reg.create_task(task("reg-idem", 4))
    assert created == 1 and len(sessions) == 4
    again, same = await reg.create_task(task("reg-idem", 4))
    assert again == 0
    assert [s.token for s in same] == [s.token for s in sessions]
    assert await reg.task_counts("reg-idem") == {"REGISTERED": 4}
    conflict, _ = await reg.create_task(task("reg-idem", 5))
    assert conflict == -1
    assert len(await reg.task_session_ids("reg-idem")) == 4


async def test_tokens_resolve_and_are_unguessable(redis_client):
    reg = Registry(redis_client)
    _, sessions = await reg.create_task(task("reg-tok", 3))
    tokens = {s.token for s in sessions}
    assert len(tokens) == 3 and all(len(t) > 40 for t in tokens)
    found = await reg.session_by_token(sessions[1].token)
    assert found.session_id == sessions[1].session_id
    assert await reg.session_by_token("ps_nope") is None


async def test_illegal_transition_is_refused(redis_client):
    reg = Registry(redis_client)
    _, sessions = await reg.create_task(task("reg-illegal", 1))
    sid = sessions[0].session_id
    t = await reg.transition(sid, SessionState.RUNNING)  # REGISTERED -> RUNNING is not allowed
    assert not t.ok and t.from_state == SessionState.REGISTERED
    assert (await reg.get_session(sid)).state == SessionState.REGISTERED
    missing = await reg.transition("nope-0000", SessionState.INITIALIZING)
    assert not missing.ok and not missing.exists


async def test_50_concurrent_writers_exactly_one_wins(redis_url):
    import redis.asyncio as aioredis

    clients = [aioredis.from_url(redis_url) for _ in range(10)]
    regs = [Registry(c) for c in clients]
    _, sessions = await regs[0].create_task(task("reg-race", 20))
    try:
        for s in sessions:  # 20 rounds, each a fresh race of 50 writers
            results = await asyncio.gather(
                *(
                    regs[i % 10].transition(s.session_id, SessionState.INITIALIZING, node=f"n{i}")
                    for i in range(50)
                )
            )
            winners = [r for r in results if r.ok]
            assert len(winners) == 1
            assert winners[0].version == 1
            after = await regs[0].get_session(s.session_id)
            assert after.state == SessionState.INITIALIZING and after.version == 1
        # versioned CAS: 50 writers expecting version 1, one wins
        sid = sessions[0].session_id
        results = await asyncio.gather(
            *(
                regs[i % 10].transition(sid, SessionState.ERROR, expect_version=1, reason=f"w{i}")
                for i in range(50)
            )
        )
        assert sum(r.ok for r in results) == 1
        counts = await regs[0].task_counts("reg-race")
        assert counts == {"INITIALIZING": 19, "ERROR": 1}
    finally:
        for c in clients:
            await c.aclose()


async def test_transition_emits_event(redis_client, bus):
    async def publish(subject, payload, msg_id):
        await bus.publish(subject, payload, msg_id=msg_id)

    reg = Registry(redis_client, publish)
    _, sessions = await reg.create_task(task("reg-ev", 1))
    sid = sessions[0].session_id
    sub = await bus.nc.subscribe(S.session_event("INITIALIZING"))
    assert (await reg.transition(sid, SessionState.INITIALIZING, node="n1")).ok
    ev = decode_event((await sub.next_msg(timeout=5)).data)
    while ev.session_id != sid:  # other tests may emit concurrently
        ev = decode_event((await sub.next_msg(timeout=5)).data)
    assert ev.session_id == sid and ev.to_state == SessionState.INITIALIZING
    assert ev.from_state == SessionState.REGISTERED and ev.node == "n1" and ev.version == 1
    await sub.unsubscribe()
    # a later change names the node too (the pool admits on its own node's run ends)
    sub = await bus.nc.subscribe(S.session_event("READY"))
    assert (await reg.transition(sid, SessionState.READY)).ok
    ev = decode_event((await sub.next_msg(timeout=5)).data)
    while ev.session_id != sid:
        ev = decode_event((await sub.next_msg(timeout=5)).data)
    assert (ev.to_state, ev.node) == (SessionState.READY, "n1")
    await sub.unsubscribe()


async def test_node_stage_sets_and_global_order(redis_client):
    reg = Registry(redis_client)
    _, sessions = await reg.create_task(task("reg-node", 3))
    a, b, c = (s.session_id for s in sessions)
    t1 = await reg.transition(a, SessionState.INITIALIZING, node="nX")
    t2 = await reg.transition(b, SessionState.INITIALIZING, node="nX")
    await reg.transition(a, SessionState.READY)
    await reg.transition(c, SessionState.INITIALIZING, node="nY")
    counts = await reg.node_stage_counts("nX", [SessionState.INITIALIZING, SessionState.READY])
    assert counts == {"INITIALIZING": 1, "READY": 1}
    assert await reg.node_sessions("nY", SessionState.INITIALIZING) == [c]
    await reg.transition(a, SessionState.CANCELLED)
    assert await reg.node_sessions("nX", SessionState.READY) == []
    assert t1.ok and t2.ok


async def test_readers_of_task_and_session_fields_go_through_the_registry(redis_client):
    """The callback status, every task id, a session's runtime: functions of the
    registry (the scheduler, the dashboard and the reaper read no raw hash)."""
    reg = Registry(redis_client)
    await reg.create_task(task("reg-fields", 2))
    await reg.create_task(task("reg-fields-b", 1))
    ids = await reg.task_ids()
    assert {"reg-fields", "reg-fields-b"} <= set(ids)
    assert not any(":" in i for i in ids)  # not the tasks' :sessions / :counts keys
    assert await reg.callback_status("reg-fields") is None
    await reg.set_callback_status("reg-fields", "failed")
    assert await reg.callback_status("reg-fields") == "failed"
    sid = "reg-fields-0000"
    assert await reg.runtime_id(sid) is None
    await reg.transition(sid, SessionState.INITIALIZING)
    await reg.transition(sid, SessionState.READY, runtime_id="rt-7")
    assert await reg.runtime_id(sid) == "rt-7"


async def test_task_specs_are_read_once_and_unknown_tasks_are_none(redis_client):
    reg = Registry(redis_client)
    await reg.create_task(task("reg-spec", 2))
    assert await reg.task_spec("reg-nope") is None
    spec = await reg.task_spec("reg-spec")
    assert spec.num_samples == 2
    # cached: a spec never changes under its id, so the second read asks nothing
    key = S.key_task("reg-spec")
    stored = await redis_client.hget(key, "spec")
    await redis_client.hset(key, "spec", b"not json")
    try:
        assert await reg.task_spec("reg-spec") == spec
        record = await reg.get_task("reg-spec")  # the task's status and time are read anew
        assert (record.spec, record.status) == (spec, "active")
    finally:  # other tests' readers (the scheduler's reconcile) see this registry too
        await redis_client.hset(key, "spec", stored)
        await reg.retire_task("reg-spec")
    assert await reg.get_task("reg-nope") is None


async def test_a_change_drops_the_lease_only_of_the_holder_it_names(redis_client):
    """``release_lease``: the holder's last change lets go of its lease in the same step
    (the executor's POSTRUN: no release of its own after it), but never another holder's
    (a new attempt's, taken while the named one was cut off)."""
    reg = Registry(redis_client)
    _, (mine, other) = await reg.create_task(task("reg-drop", 2))
    for s in (mine, other):
        await reg.transition(s.session_id, SessionState.INITIALIZING, lease=("pool:a", 60))
        await reg.transition(s.session_id, SessionState.READY)
    await reg.transition(mine.session_id, SessionState.RUNNING, lease=("executor:a", 60))
    await reg.transition(other.session_id, SessionState.RUNNING, lease=("executor:b", 60))

    done = await reg.transition(
        mine.session_id, SessionState.POSTRUN, release_lease="executor:a", outcome="completed"
    )
    assert done.ok
    assert await redis_client.zscore(S.KEY_LEASES, mine.session_id) is None
    assert (await reg.get_session(mine.session_id)).outcome == "completed"  # fields still set

    kept = await reg.transition(
        other.session_id, SessionState.POSTRUN, release_lease="executor:a", outcome="completed"
    )
    assert kept.ok
    assert await redis_client.zscore(S.KEY_LEASES, other.session_id) is not None
    await reg.release(other.session_id)
    await reg.retire_task("reg-drop")


async def test_a_task_and_its_counts_in_one_read(redis_client):
    reg = Registry(redis_client)
    assert await reg.task_and_counts("reg-both-nope") == (None, {})
    _, sessions = await reg.create_task(task("reg-both", 3))
    await reg.transition(sessions[0].session_id, SessionState.INITIALIZING)
    fresh = Registry(redis_client)  # nothing cached: the spec is read with the task
    record, counts = await fresh.task_and_counts("reg-both")
    assert record == await reg.get_task("reg-both") and record.spec.num_samples == 3
    assert counts == {"REGISTERED": 2, "INITIALIZING": 1} == await reg.task_counts("reg-both")
    again, _ = await fresh.task_and_counts("reg-both")  # the spec from the cache now
    assert again == record
    await reg.retire_task("reg-both")
