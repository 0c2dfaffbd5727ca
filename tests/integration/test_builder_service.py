"""The trajectory builder service against real NATS JetStream and Valkey."""

from __future__ import annotations

import asyncio
import random
import time

import msgspec
import pytest
from litestar.testing import AsyncTestClient
from nats.js.errors import NotFoundError
from prometheus_client import REGISTRY

from schemas import (
    AgentSpec,
    Artifacts,
    BuilderSpec,
    CompletionRecord,
    Outcome,
    SessionFinished,
    SessionState,
    TaskRequest,
    Trajectory,
    TrajectoryBuilt,
    decode,
    encode,
)
from schemas import subjects as S
from schemas.completion import ToolParse, ToolParseFailure
from services.builder import logic
from services.builder.config import BuilderConfig
from services.builder.handlers import Builder
from services.builder.main import consumers, create_app
from services.common.registry import Registry
from tests.helpers.procs import ServiceProcess
from tests.unit.builder.synth import Capture, agent_loop
from tests.unit.builder.test_fixtures import load

pytestmark = pytest.mark.asyncio
CUSTOM = "tests.unit.builder.custom_builders"
POSTRUN_PATH = ("INITIALIZING", "READY", "RUNNING", "POSTRUN")


@pytest.fixture
async def registry(redis_client):
    # No state events from these tests: other suites read polar.events.* from the start.
    return Registry(redis_client)


@pytest.fixture
async def builder(bus, registry):
    return Builder(bus, registry, BuilderConfig(retry_delay_seconds=0.2))


@pytest.fixture(autouse=True)
async def _remove_built_events(bus):
    """Leave no TrajectoryBuilt of these tests in the work queue for other services' tests."""
    yield
    seq = 1
    while True:
        try:
            msg = await bus.js.get_msg(
                S.STREAM_SESSIONS, seq, subject=S.ALL_SESSIONS_BUILT, next=True
            )
        except NotFoundError:
            return
        if decode(await bus.payload(msg), TrajectoryBuilt).task_id.startswith("bld-"):
            await bus.js.delete_msg(S.STREAM_SESSIONS, msg.seq)
        seq = msg.seq + 1


async def drain(builder: Builder) -> None:
    for c in consumers(builder):
        await c.run(drain=True)


async def new_task(reg, task_id, n=1, builder=BuilderSpec(), to=POSTRUN_PATH) -> list[str]:
    task = TaskRequest(
        task_id=task_id,
        instruction="x",
        num_samples=n,
        agent=AgentSpec(harness="noop"),
        builder=builder,
    )
    _, sessions = await reg.create_task(task)
    for s in sessions:
        for state in to:
            assert (await reg.transition(s.session_id, SessionState(state))).ok
    return [s.session_id for s in sessions]


async def publish_records(bus, records: list[CompletionRecord], session_id: str) -> None:
    for r in records:
        rec = msgspec.structs.replace(r, session_id=session_id)
        await bus.publish(S.completions(session_id), encode(rec), msg_id=f"c:{session_id}:{r.seq}")


def finished(session_id, task_id, outcome=Outcome.COMPLETED, **kw) -> bytes:
    return encode(SessionFinished(session_id=session_id, task_id=task_id, outcome=outcome, **kw))


async def built_events(bus, session_id: str) -> list[TrajectoryBuilt]:
    """TrajectoryBuilt messages of one session in the stream (read, not consumed)."""
    out, seq = [], 1
    while True:
        try:
            msg = await bus.js.get_msg(
                S.STREAM_SESSIONS, seq, subject=S.ALL_SESSIONS_BUILT, next=True
            )
        except NotFoundError:
            return out
        event = decode(msg.data, TrajectoryBuilt)
        if event.session_id == session_id:
            out.append(event)
        seq = msg.seq + 1


async def stored(bus, session_id: str, attempt: int = 0) -> Trajectory:
    store = await bus.js.object_store(S.OBJECT_STORE)
    obj = await store.get(S.trajectory_object(session_id, attempt))
    return decode(obj.data, Trajectory)


async def state_of(reg, session_id) -> SessionState:
    return (await reg.get_session(session_id)).state


async def test_builds_a_session_end_to_end(bus, registry, builder):
    (sid,) = await new_task(registry, "bld-e2e")
    await publish_records(bus, load("token_30turn"), sid)
    art = Artifacts(harness="codex", harness_version="0.0.1", protocol="openai_chat")
    await bus.publish(S.SESSIONS_FINISHED, finished(sid, "bld-e2e", artifacts=art))
    await drain(builder)
    (event,) = await built_events(bus, sid)
    assert (event.task_id, event.outcome, event.attempt) == ("bld-e2e", Outcome.COMPLETED, 0)
    tr = await stored(bus, sid)
    assert tr.intact and tr.builder == "prefix_merging" and tr.harness == "codex"
    assert len(tr.traces) == 1 and tr.stats.completions == 30 and tr.stats.chains == 1
    assert tr.traces[0].trace_id == f"{sid}/0"
    assert await state_of(registry, sid) == SessionState.EVALUATING
    # the run's artifacts beside it: what the dashboard shows after a restart (issue 38.12)
    blobs = await bus.js.object_store(S.OBJECT_STORE)
    kept = await blobs.get(S.artifacts_object(sid, 0))
    assert decode(kept.data, Artifacts) == art


async def test_per_request_builder_and_delta_encoded_synthetic_records(bus, registry, builder):
    (sid,) = await new_task(registry, "bld-pr", builder=BuilderSpec(name="per_request"))
    cap = Capture(sid)
    agent_loop(cap, random.Random(7), 9)
    assert sum(r.prompt_base_seq is not None for r in cap.records) > 0
    await publish_records(bus, cap.records, sid)
    await bus.publish(S.SESSIONS_FINISHED, finished(sid, "bld-pr"))
    await drain(builder)
    tr = await stored(bus, sid)
    assert len(tr.traces) == 9 and tr.stats.merge_ratio == 1.0


async def test_large_records_travel_by_claim_check(bus, registry, builder):
    (sid,) = await new_task(registry, "bld-big")
    cap = Capture(sid, delta=False)  # full prompts every time: > 1 MiB per record
    rng = random.Random(3)
    prompt = [rng.randrange(100, 100_000) for _ in range(200_000)]
    cap.call(prompt, [5, 2])
    cap.call(prompt + [5, 2, 7, 8], [9, 2], finish="stop")
    assert len(encode(cap.records[1])) > 1024 * 1024
    await publish_records(bus, cap.records, sid)
    await bus.publish(S.SESSIONS_FINISHED, finished(sid, "bld-big"))
    await drain(builder)
    tr = await stored(bus, sid)
    assert len(tr.traces) == 1 and tr.traces[0].response_ids == [5, 2, 7, 8, 9, 2]


async def test_duplicate_finished_messages_build_once(bus, registry, builder):
    (sid,) = await new_task(registry, "bld-dup")
    await publish_records(bus, load("sub_agent"), sid)
    for _ in range(2):  # no dedupe id: two messages really arrive
        await bus.publish(S.SESSIONS_FINISHED, finished(sid, "bld-dup"))
    await drain(builder)
    assert len(await built_events(bus, sid)) == 1
    tr = await stored(bus, sid)
    assert [t.break_reason for t in tr.traces] == ["first", "sub_agent", "sub_agent"]
    assert [t.lineage_id for t in tr.traces] == [None, f"{sid}/0", f"{sid}/0"]
    await bus.publish(S.SESSIONS_FINISHED, finished(sid, "bld-dup"))  # later: EVALUATING
    await drain(builder)
    assert len(await built_events(bus, sid)) == 1


async def test_crash_after_announce_before_advance_rebuilds_once(bus, registry, builder):
    (sid,) = await new_task(registry, "bld-crash")
    await publish_records(bus, load("compaction"), sid)
    event = decode(finished(sid, "bld-crash"), SessionFinished)
    # A first builder takes the session, builds, stores, announces... and dies.
    assert (await builder.take(event)).action == logic.Action.BEGIN
    first = await builder.make(event)
    await builder.store(first)
    await builder.announce(first, event)
    assert await state_of(registry, sid) == SessionState.BUILDING
    # The SessionFinished is redelivered: found BUILDING, rebuilt, announced once.
    await bus.publish(S.SESSIONS_FINISHED, finished(sid, "bld-crash"))
    await drain(builder)
    assert len(await built_events(bus, sid)) == 1
    assert await stored(bus, sid) == first  # the rebuild is the same trajectory
    reasons = [t.break_reason for t in first.traces]
    assert reasons == ["first", "side_call:compaction", "compaction"]
    assert first.metadata["builder_notes"]["retagged_chains"] == {"2": "side_call:title"}
    assert await state_of(registry, sid) == SessionState.EVALUATING


async def test_timeout_without_records_still_builds(bus, registry, builder):
    (sid,) = await new_task(registry, "bld-empty")
    await bus.publish(
        S.SESSIONS_FINISHED, finished(sid, "bld-empty", Outcome.TIMEOUT, reason="agent timeout")
    )
    await drain(builder)
    tr = await stored(bus, sid)
    assert tr.traces == [] and tr.outcome == Outcome.TIMEOUT and tr.reward == 0.0
    assert len(await built_events(bus, sid)) == 1


async def test_failing_builder_still_delivers_a_flagged_trajectory(bus, registry, builder):
    (sid,) = await new_task(registry, "bld-broken", builder=BuilderSpec(name=f"{CUSTOM}:Broken"))
    await publish_records(bus, load("side_calls"), sid)
    await bus.publish(S.SESSIONS_FINISHED, finished(sid, "bld-broken"))
    await drain(builder)
    tr = await stored(bus, sid)
    assert not tr.intact and "always fails" in tr.metadata["build_error"]
    assert len(tr.traces) == 4 and not any(t.trainable for t in tr.traces)
    assert await state_of(registry, sid) == SessionState.EVALUATING


async def dlq_reasons(bus, session_id: str) -> list[str]:
    out, seq = [], 1
    while True:
        try:
            msg = await bus.js.get_msg(
                S.STREAM_DLQ, seq, subject=S.dead_letter(S.STREAM_SESSIONS), next=True
            )
        except NotFoundError:
            return out
        if session_id.encode() in msg.data:
            out.append(msg.headers.get("Polar-Reason", ""))
        seq = msg.seq + 1


async def test_unknown_session_is_dead_lettered_with_the_reason(bus, builder):
    await bus.publish(S.SESSIONS_FINISHED, finished("ghost-0000", "ghost"))
    await bus.publish(S.SESSIONS_FINISHED, b"{not json")
    await drain(builder)
    assert await dlq_reasons(bus, "ghost-0000") == ["no session 'ghost-0000' in the registry"]


async def test_waits_for_postrun(bus, registry):
    builder = Builder(bus, registry, BuilderConfig(retry_delay_seconds=0.5))
    (sid,) = await new_task(registry, "bld-early", to=POSTRUN_PATH[:3])  # still RUNNING
    await bus.publish(S.SESSIONS_FINISHED, finished(sid, "bld-early"))
    await drain(builder)  # nak'd for later: the drain's idle wait (0.3 s) is shorter
    assert await state_of(registry, sid) == SessionState.RUNNING
    assert await built_events(bus, sid) == []
    assert (await registry.transition(sid, SessionState.POSTRUN)).ok
    await asyncio.sleep(0.6)  # past the retry delay
    await drain(builder)
    assert await state_of(registry, sid) == SessionState.EVALUATING


async def test_a_session_that_never_reaches_postrun_is_dead_lettered(bus, registry):
    builder = Builder(bus, registry, BuilderConfig(retry_delay_seconds=0.05, max_deliver=3))
    (sid,) = await new_task(registry, "bld-never", to=POSTRUN_PATH[:3])
    await bus.publish(S.SESSIONS_FINISHED, finished(sid, "bld-never"))
    await drain(builder)
    (reason,) = await dlq_reasons(bus, sid)
    assert reason == "still not ready after 3 tries: session is RUNNING, not POSTRUN yet"


async def test_app_serves_health_and_metrics_while_building(nats_url, redis_url, bus, registry):
    (sid,) = await new_task(registry, "bld-app")
    await publish_records(bus, load("side_calls"), sid)
    app = create_app(BuilderConfig(nats_url=nats_url, redis_url=redis_url))
    async with AsyncTestClient(app) as client:
        await bus.publish(S.SESSIONS_FINISHED, finished(sid, "bld-app"))
        deadline = time.monotonic() + 20
        while await state_of(registry, sid) != SessionState.EVALUATING:
            assert time.monotonic() < deadline, "not built in time"
            await asyncio.sleep(0.1)
        health = await client.get("/healthz")
        assert health.status_code == 200 and health.json()["ok"]
        text = (await client.get("/metrics")).text
    assert 'polar_builder_builds_total{builder="prefix_merging",result="built"}' in text
    assert 'polar_builder_breaks_total{reason="side_call:title"}' in text
    for name in ("tokens_total", "merge_ratio_bucket", "build_seconds_bucket"):
        assert f"polar_builder_{name}" in text


async def test_kill_9_mid_build_then_restart_builds_each_session_once(
    nats_url, redis_url, bus, registry, state_dir
):
    spec = BuilderSpec(name=f"{CUSTOM}:Slow", config={"sleep_seconds": 1.0})
    sids = await new_task(registry, "bld-kill", n=6, builder=spec)
    for i, sid in enumerate(sids):
        cap = Capture(sid)
        agent_loop(cap, random.Random(i), 5)
        await publish_records(bus, cap.records, sid)
    cfg = {"nats_url": nats_url, "redis_url": redis_url, "ack_wait_seconds": 1.5, "concurrency": 2}
    proc = ServiceProcess("services.builder.main:create_app", cfg, state_dir / "logs").start()
    try:
        for sid in sids:
            await bus.publish(S.SESSIONS_FINISHED, finished(sid, "bld-kill"))
        killed_while_building = set()
        for _ in range(2):  # kill -9 while a session is BUILDING, twice if any is left
            # Under load the restarted builder can rebuild every session before its
            # /healthz answers (CI: nothing BUILDING for 30 s): then there is no second kill.
            assert await wait_until(lambda: building_or_done(registry, sids))
            if await all_in(registry, sids, SessionState.EVALUATING):
                break
            proc.kill()
            sessions = await registry.get_sessions(sids)
            killed_while_building |= {s.session_id for s in sessions if s.state == "BUILDING"}
            proc.start()
        assert killed_while_building  # builds really were interrupted
        assert await wait_until(lambda: all_in(registry, sids, SessionState.EVALUATING), 60)
    finally:
        proc.stop()
    for sid in sids:
        assert len(await built_events(bus, sid)) == 1
        assert (await stored(bus, sid)).stats.completions == 5


async def wait_until(predicate, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.02)
    return False


async def any_in(reg, sids, state) -> bool:
    return any(s.state == state for s in await reg.get_sessions(sids))


async def all_in(reg, sids, state) -> bool:
    return all(s.state == state for s in await reg.get_sessions(sids))


async def building_or_done(reg, sids) -> bool:
    states = {s.state for s in await reg.get_sessions(sids)}
    return SessionState.BUILDING in states or states == {SessionState.EVALUATING}


async def test_a_call_in_flight_when_the_session_ended_is_waited_for(bus, registry, builder):
    # issue 17.5: records committed after the builder read a session never reached its
    # trajectory (6 of 65). The proxy numbered 3 calls; the last one's record arrives
    # while the build is under way, and is in the trajectory.
    (sid,) = await new_task(registry, "bld-late")
    cap = Capture(sid)
    agent_loop(cap, random.Random(11), 3)
    await registry.redis.set(S.key_call_seq(sid), 3)  # as the proxy's numbering left it
    await publish_records(bus, cap.records[:2], sid)
    event = decode(finished(sid, "bld-late"), SessionFinished)
    assert (await builder.take(event)).action == logic.Action.BEGIN
    making = asyncio.create_task(builder.make(event))
    await asyncio.sleep(0.5)
    assert not making.done()  # waiting for call 2
    await publish_records(bus, cap.records[2:], sid)
    tr = await asyncio.wait_for(making, 10)
    assert tr.stats.completions == 3 and tr.intact


async def test_a_number_that_never_gets_a_record_is_waited_for_boundedly(bus, registry):
    builder = Builder(bus, registry, BuilderConfig(settle_seconds=0.5))
    (sid,) = await new_task(registry, "bld-lost")
    cap = Capture(sid)
    agent_loop(cap, random.Random(12), 2)
    await registry.redis.set(S.key_call_seq(sid), 3)  # call 2 died with its proxy
    await publish_records(bus, cap.records, sid)
    event = decode(finished(sid, "bld-lost"), SessionFinished)
    assert (await builder.take(event)).action == logic.Action.BEGIN
    t0 = time.monotonic()
    tr = await builder.make(event)
    assert 0.5 <= time.monotonic() - t0 < 5 and tr.stats.completions == 2


async def test_a_retried_attempt_is_not_blamed_for_a_number_its_predecessor_never_recorded(
    fresh_servers,
):
    """Attempt 0 took call numbers 0-2 and recorded 0 and 1: its node was cut off with
    call 2 in flight, so neither its record nor a void one ever came (the proxy logs "left
    a gap"). The reaper's retry starts attempt 1 at the counter (``seq_floor`` 3); its
    calls 3 and 4 build an intact trajectory, without waiting out the settle window for
    number 2. Before: not intact ("completions missing: seqs [2]"), fully masked, after
    the whole wait (the multi-host chaos test's retried sessions, in a .ci/run rehearsal)."""
    from proxy.callcount import number_call
    from services.common.bus import Bus
    from services.common.finish import finish_session
    from services.node.reaper import retry_session

    nats_url, redis_url = fresh_servers
    bus = await Bus.open(nats_url, "test-seq-floor")
    registry = Registry.from_url(redis_url)
    settle = 30.0
    builder = Builder(bus, registry, BuilderConfig(retry_delay_seconds=0.2, settle_seconds=settle))
    try:
        (sid,) = await new_task(registry, "bld-floor", to=POSTRUN_PATH[:3])  # RUNNING
        first, again = Capture(sid), Capture(sid)
        agent_loop(first, random.Random(5), 2)
        agent_loop(again, random.Random(5), 2)
        assert [await number_call(registry.redis, sid) for _ in range(3)] == [0, 1, 2]
        await publish_records(bus, first.records, sid)  # seqs 0 and 1; 2 never comes
        assert await retry_session(registry, bus, await registry.get_session(sid), "holder lost")
        for state in POSTRUN_PATH[:3]:
            assert (await registry.transition(sid, SessionState(state))).ok
        retried = await registry.get_session(sid)
        assert (retried.attempt, retried.seq_floor) == (1, 3)
        assert [await number_call(registry.redis, sid) for _ in range(2)] == [3, 4]
        mine = [
            msgspec.structs.replace(
                r,
                seq=r.seq + 3,
                attempt=1,
                prompt_base_seq=None if r.prompt_base_seq is None else r.prompt_base_seq + 3,
            )
            for r in again.records
        ]
        await publish_records(bus, mine, sid)
        assert await finish_session(
            registry, bus, retried, 1, Outcome.COMPLETED, None, Artifacts(), None
        )
        t0 = time.monotonic()
        await drain(builder)
        tr = await stored(bus, sid, attempt=1)
        assert time.monotonic() - t0 < settle  # number 2 was not waited for
        assert tr.intact and "integrity_problems" not in tr.metadata, tr.metadata
        assert [t.completion_seqs for t in tr.traces] == [[3, 4]]
        assert tr.metadata["earlier_attempt_records"] == 2
    finally:
        await registry.close()
        await bus.close()


async def test_tool_parse_health_reaches_the_trajectory_and_the_metrics(bus, registry, builder):
    (sid,) = await new_task(registry, "bld-tools")
    cap = Capture(sid)
    agent_loop(cap, random.Random(5), 3)
    bad = ToolParseFailure(kind="malformed", detail="unterminated", start=1, end=3)
    parses = [
        ToolParse(ok=True, family="qwen3", calls=1),
        ToolParse(ok=False, family="qwen3", failures=[bad]),
        None,  # no tools offered
    ]
    records = [
        msgspec.structs.replace(r, tool_parse=p) for r, p in zip(cap.records, parses, strict=True)
    ]
    await publish_records(bus, records, sid)

    def value(name: str, **labels: str) -> float:
        return (
            REGISTRY.get_sample_value(name, {"harness": "codex", "family": "qwen3", **labels}) or 0
        )

    failed_before = value("polar_builder_tool_calls_failed_total", kind="malformed")
    sessions_before = value("polar_builder_tool_parse_sessions_total", result="failed")
    checked_before = value("polar_builder_tool_calls_checked_total")
    art = Artifacts(harness="codex")
    await bus.publish(S.SESSIONS_FINISHED, finished(sid, "bld-tools", artifacts=art))
    await drain(builder)
    traj = await stored(bus, sid)
    (trace,) = traj.traces
    (f,) = trace.tool_parse.failures
    assert f.seq == 1 and trace.response_ids[f.start : f.end] == records[1].output_ids[1:3]
    assert traj.stats.tool_calls_failed == {"malformed": 1} and traj.stats.tool_turns == 2
    assert value("polar_builder_tool_calls_failed_total", kind="malformed") == failed_before + 1
    assert value("polar_builder_tool_parse_sessions_total", result="failed") == sessions_before + 1
    assert value("polar_builder_tool_calls_checked_total") == checked_before + 2
