"""The trainer-side client against real NATS JetStream (and, end to end, the evaluator)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from schemas import EvaluatorSpec, Outcome, TaskRequest, Trajectory, encode
from schemas import subjects as S
from services.client import TrajectoryClient
from services.client.groups import GroupBuffer, expected_size
from services.common.registry import Registry
from services.evaluator.config import EvaluatorConfig
from services.evaluator.handlers import EvaluatorService
from services.evaluator.logic import trajectory_msg_id
from services.evaluator.main import consumers
from tests.unit.evaluators.sessions import announce, new_sessions, remove_built, unscored


def scored(task_id: str, i: int, n: int, *, tokens: int = 4, attempt: int = 0) -> Trajectory:
    t = unscored(f"{task_id}-{i:04d}", task_id, tokens=tokens)
    return msgspec.structs.replace(
        t,
        attempt=attempt,
        reward=1.0,
        eval_status="ok",
        metadata={**t.metadata, "num_samples": n, "sample_index": i},
    )


async def publish(bus, t: Trajectory, msg_id: str | None = None) -> None:
    mid = msg_id or trajectory_msg_id(t.session_id, t.attempt)
    await bus.publish(S.trajectories(t.task_id), encode(t), msg_id=mid)


@pytest.fixture
async def clients(nats_url):
    """Clients made by a test, closed and their durables deleted afterwards."""
    made: list[TrajectoryClient] = []

    async def make(durable: str, task_ids, **kw) -> TrajectoryClient:
        c = TrajectoryClient(nats_url, durable=durable, task_ids=task_ids, poll_seconds=0.3, **kw)
        made.append(await c.connect())
        return c

    yield make
    for c in made:
        if c.bus.nc.is_closed:
            continue
        await c.delete_consumer()
        await c.close()


async def take(agen, n: int, timeout: float = 10.0) -> list:
    out = []

    async def run():
        async for x in agen:
            out.append(x)
            if len(out) == n:
                return

    await asyncio.wait_for(run(), timeout)
    return out


async def test_groups_complete_only_when_every_sample_arrived(bus, clients):
    c = await clients("cl-groups", ["cl-groups"])
    for i in range(2):
        await publish(bus, scored("cl-groups", i, 3))
    assert [g async for g in c.groups(stop_when_idle=True)] == []  # 2 of 3: no group yet
    await publish(bus, scored("cl-groups", 2, 3))
    (group,) = [g async for g in c.groups(stop_when_idle=True)]
    assert group.complete and group.task_id == "cl-groups"
    assert sorted(t.session_id for t in group.trajectories) == [
        f"cl-groups-{i:04d}" for i in range(3)
    ]
    await group.commit()
    await c.close()
    again = await clients("cl-groups", ["cl-groups"])
    assert [t async for t in again.trajectories(stop_when_idle=True)] == []


async def test_nothing_is_acked_before_commit(bus, clients):
    for i in range(3):
        await publish(bus, scored("cl-commit", i, 3))
    before = time.monotonic()  # every delivery to the first client comes after this
    first = await clients("cl-commit", ["cl-commit"], ack_wait=1.0)
    items = await take(first.trajectories(), 3)
    await items[0].commit()  # one committed, two not
    await first.bus.nc.close()  # the trainer dies: no nak, no ack
    second = await clients("cl-commit", ["cl-commit"], ack_wait=1.0)
    again = await take(second.trajectories(), 2)
    # redelivered after ack_wait, not before. Counted from before the first delivery, not
    # from the second client's start: a loaded machine can spend most of ack_wait on it
    assert time.monotonic() - before >= 0.9
    assert sorted(i.trajectory.session_id for i in again) == ["cl-commit-0001", "cl-commit-0002"]
    for item in again:
        await item.commit()
    await second.close()
    third = await clients("cl-commit", ["cl-commit"], ack_wait=1.0)
    assert [t async for t in third.trajectories(stop_when_idle=True)] == []


async def test_held_items_stay_held_past_ack_wait(bus, clients):
    """The keepalive holds uncommitted items: no redelivery to this client or another."""
    for i in range(2):
        await publish(bus, scored("cl-hold", i, 2))
    # 2 s: the keepalive comes every third of it, so only a 1.3 s stall of this process
    # (not 0.67 s, which a loaded machine can give) would let the server redeliver
    holder = await clients("cl-hold", ["cl-hold"], ack_wait=2.0)
    (group,) = await take(holder.groups(), 1)
    other = TrajectoryClient(
        holder.nats_url, durable="cl-hold", task_ids=["cl-hold"], ack_wait=2.0, poll_seconds=0.3
    )
    await other.connect()
    try:
        got = await asyncio.wait_for(_collect_for(other, 6.0), 20)
        assert got == []  # 3 ack_waits later, nothing came back
        assert [t async for t in holder.trajectories(stop_when_idle=True)] == []
    finally:
        await other.close()
    await group.commit()


async def _collect_for(client: TrajectoryClient, seconds: float) -> list:
    out, end = [], time.monotonic() + seconds
    async for item in client._deliveries(stop_when_idle=False):
        if item is not None:
            out.append(item)
        if time.monotonic() > end:
            return out
    return out


async def test_a_closed_client_releases_what_it_held(bus, clients):
    await publish(bus, scored("cl-release", 0, 1))
    a = await clients("cl-release", ["cl-release"], ack_wait=30.0)
    (item,) = await take(a.trajectories(), 1)
    await a.close()  # naks: redelivered at once, not after 30 s
    b = await clients("cl-release", ["cl-release"], ack_wait=30.0)
    (again,) = await take(b.trajectories(), 1, timeout=5)
    assert again.trajectory == item.trajectory
    await again.commit()


async def test_duplicates_are_handed_out_once_and_claim_checks_resolved(bus, clients):
    big = scored("cl-dup", 0, 2, tokens=120_000)  # over the NATS payload limit
    await publish(bus, big)
    await publish(bus, big, msg_id="republished-by-hand")  # a real second copy in the stream
    await publish(bus, scored("cl-dup", 1, 2))
    c = await clients("cl-dup", ["cl-dup"])
    items = [i async for i in c.trajectories(stop_when_idle=True)]
    assert sorted(i.trajectory.session_id for i in items) == ["cl-dup-0000", "cl-dup-0001"]
    got_big = next(i for i in items if i.trajectory.session_id == "cl-dup-0000")
    assert got_big.trajectory.traces[0].response_ids == big.traces[0].response_ids
    for i in items:
        await i.commit()


async def test_task_filter_and_explicit_group_size(bus, clients):
    for task_id in ("cl-fa", "cl-fb", "cl-fc"):
        for i in range(2):
            await publish(bus, scored(task_id, i, 2))
    c = await clients("cl-filter", ["cl-fa", "cl-fc"])
    groups = [g async for g in c.groups(num_samples=1, stop_when_idle=True)]
    assert sorted(g.task_id for g in groups) == ["cl-fa", "cl-fa", "cl-fc", "cl-fc"]
    assert all(len(g.items) == 1 for g in groups)
    for g in groups:
        await g.commit()


async def test_partial_groups_after_a_quiet_period(bus, clients):
    await publish(bus, scored("cl-partial", 0, 4))  # the other 3 were cancelled
    c = await clients("cl-partial", ["cl-partial"])
    (group,) = await take(c.groups(partial_after=0.5), 1)
    assert not group.complete and len(group.items) == 1
    await group.commit()


async def test_groups_never_block_forever_by_default(bus, clients):
    """No ``partial_after`` given: the client's group timeout settles a short group."""
    await publish(bus, scored("cl-default", 0, 3))  # 2 of 3 never come
    c = await clients("cl-default", ["cl-default"], group_timeout=0.5)
    (group,) = await take(c.groups(), 1)
    assert not group.complete and len(group.items) == 1
    await group.commit()
    assert TrajectoryClient("nats://x").group_timeout == 900.0  # the stated default


async def test_drop_policy_commits_short_groups_untrained_and_counts_them(bus, clients, nats_url):
    for i in range(2):
        await publish(bus, scored("cl-drop", i, 3))
    await publish(bus, scored("cl-drop2", 0, 1))
    c = await clients("cl-drop", ["cl-drop", "cl-drop2"], group_timeout=0.5, on_partial="drop")
    (group,) = await take(c.groups(), 1)  # the whole one
    assert group.task_id == "cl-drop2" and group.complete
    await group.commit()

    async def dropped():
        async for _ in c.groups():
            pytest.fail("a short group was yielded under on_partial='drop'")

    with pytest.raises(TimeoutError):  # long enough for a loaded machine to see the
        await asyncio.wait_for(dropped(), 5.0)  # short group out (0.5 s) and drop it
    assert (c.dropped.groups, c.dropped.trajectories) == (1, 2)
    await c.close()
    again = await clients("cl-drop", ["cl-drop", "cl-drop2"])  # same durable: acked for good
    assert [g async for g in again.groups(num_samples=1, stop_when_idle=True)] == []


async def test_a_durable_left_by_a_client_that_is_gone_is_dropped_by_the_server(bus, nats_url):
    """A trainer that dies (or a run that ends without deleting its consumer) must not
    leave a durable whose pending count grows forever (issue 38.4): with an
    ``inactive_threshold`` the server drops it once no client is bound for that long."""
    c = TrajectoryClient(nats_url, durable="idle-one", task_ids=["idle"], inactive_threshold=1.0)
    await c.connect()
    info = await bus.js.consumer_info(S.STREAM_TRAJECTORIES, "idle-one")
    assert info.config.inactive_threshold == 1.0
    await c.close()  # gone without deleting its durable

    async def dropped() -> None:
        while "idle-one" in {i.name for i in await bus.js.consumers_info(S.STREAM_TRAJECTORIES)}:
            await asyncio.sleep(0.2)

    await asyncio.wait_for(dropped(), 30)


def test_bad_partial_policies_are_refused():
    with pytest.raises(ValueError, match="on_partial"):
        TrajectoryClient("nats://x", on_partial="wait")
    with pytest.raises(ValueError, match="group_timeout"):
        TrajectoryClient("nats://x", group_timeout=0)


async def test_end_to_end_evaluator_to_trainer_groups(bus, redis_client, state_dir, clients):
    reg = Registry(redis_client)
    task = TaskRequest(task_id="cl-e2e", instruction="x", num_samples=4, evaluator=EvaluatorSpec())
    sids = await new_sessions(reg, task)
    outcomes = [Outcome.COMPLETED, Outcome.COMPLETED, Outcome.TIMEOUT, Outcome.COMPLETED]
    for sid, outcome in zip(sids, outcomes, strict=True):
        await announce(bus, unscored(sid, "cl-e2e", outcome))
    service = EvaluatorService(bus, reg, EvaluatorConfig(work_dir=str(state_dir / "clwork")))
    try:
        for c in consumers(service):
            await c.run(drain=True)
    finally:
        await remove_built(bus, "cl-")
    client = await clients("cl-e2e", ["cl-e2e"])
    (group,) = [g async for g in client.groups(stop_when_idle=True)]
    assert sorted((t.session_id, t.reward) for t in group.trajectories) == [
        (sids[0], 1.0),
        (sids[1], 1.0),
        (sids[2], 0.0),
        (sids[3], 1.0),
    ]
    await group.commit()


def test_group_buffer():
    buf: GroupBuffer[str] = GroupBuffer()
    assert buf.add("t", ("s0", 0), "a", 2, now=0.0) is None
    assert buf.add("t", ("s0", 0), "a2", 2, now=1.0) is None  # same member again
    assert buf.has("t", ("s0", 0)) and buf.held() == 1
    assert buf.add("t", ("s1", 0), "b", 2, now=2.0) == ["a2", "b"]
    assert buf.held() == 0
    buf.add("u", ("s0", 0), "x", None, now=0.0)  # size unknown: waits
    assert buf.stale(now=1.0, after=5.0) == []
    assert buf.stale(now=6.0, after=5.0) == [("u", ["x"])] and buf.held() == 0
    assert expected_size({"num_samples": 8}, None) == 8
    assert expected_size({"num_samples": 8}, 2) == 2
    assert expected_size({}, None) is None and expected_size({"num_samples": "8"}, None) is None


async def test_export_reads_the_stored_trajectories(bus, nats_url, tmp_path):
    """`polar export` over what is on polar.trajectories.<task>: claim-checked ones and a
    duplicate included, exported once; failed evaluations left out."""
    import orjson
    import typer
    from typer.testing import CliRunner

    from services.cli.export import export_command

    pq = pytest.importorskip("pyarrow.parquet")
    good = [scored("cl-export", i, 3) for i in range(2)]
    big = scored("cl-export", 2, 3, tokens=80_000)  # claim-checked
    failed = msgspec.structs.replace(
        scored("cl-export", 3, 4), reward=None, eval_status="error", eval_reason="boom"
    )
    for t in (*good, big, failed):
        await publish(bus, t)
    await publish(bus, good[0], msg_id="a-second-copy")
    await publish(bus, scored("cl-other", 0, 1))

    app = typer.Typer()
    app.command()(export_command)
    runner = CliRunner()

    sft = tmp_path / "sft.jsonl"
    result = await asyncio.to_thread(
        runner.invoke, app, ["--nats-url", nats_url, "--task", "cl-export", "--out", str(sft)]
    )
    assert result.exit_code == 0, result.output
    assert "3 rows from 3 of 4 trajectories" in result.output
    rows = [orjson.loads(line) for line in sft.read_bytes().splitlines()]
    assert sorted(r["session_id"] for r in rows) == [
        "cl-export-0000",
        "cl-export-0001",
        "cl-export-0002",
    ]
    assert len(next(r for r in rows if r["session_id"] == "cl-export-0002")["tokens"]) == 160_000

    slime = tmp_path / "slime.parquet"
    args = [
        "--nats-url",
        nats_url,
        "--task",
        "cl-export",
        "--layout",
        "slime",
        "--format",
        "parquet",
    ]
    result = await asyncio.to_thread(runner.invoke, app, [*args, "--out", str(slime)])
    assert result.exit_code == 0, result.output
    table = pq.read_table(slime).to_pylist()
    assert sorted(r["rollout_id"] for r in table) == [
        f"cl-export-000{i}:0:cl-export-000{i}/0" for i in range(3)
    ]
    assert all(r["group_id"] == "cl-export" and r["reward"] == 1.0 for r in table)

    down = await asyncio.to_thread(
        runner.invoke, app, ["--nats-url", "nats://127.0.0.1:1", "--out", str(tmp_path / "x")]
    )
    assert down.exit_code == 1 and "cannot reach NATS" in down.output


async def test_export_reads_the_topologys_nats_url(bus, nats_url, tmp_path):
    """`polar export -t topology.yaml` finds NATS where every other command does."""
    import orjson
    import typer
    from typer.testing import CliRunner

    from services.cli.export import export_command

    await publish(bus, scored("cl-topo", 0, 1))
    topo = tmp_path / "topology.yaml"
    topo.write_text(f"nats_url: {nats_url}\nstate_dir: '{tmp_path / 'state'}'\n")
    app = typer.Typer()
    app.command()(export_command)
    out = tmp_path / "t.jsonl"
    args = ["-t", str(topo), "--task", "cl-topo", "--out", str(out)]
    result = await asyncio.to_thread(CliRunner(env={"POLAR_NATS_URL": None}).invoke, app, args)
    assert result.exit_code == 0, result.output
    assert [orjson.loads(line)["session_id"] for line in out.read_bytes().splitlines()] == [
        "cl-topo-0000"
    ]
    broken = tmp_path / "broken.yaml"
    broken.write_text("nats_url: [not, a, url]\n")
    bad = await asyncio.to_thread(CliRunner().invoke, app, ["-t", str(broken), "--out", str(out)])
    assert bad.exit_code == 1 and "error:" in bad.output
