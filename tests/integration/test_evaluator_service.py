"""The evaluator service against real NATS JetStream, Valkey and local runtimes."""

from __future__ import annotations

import asyncio
import random
import sys
import time

import pytest

from schemas import (
    Artifacts,
    EvaluatorSpec,
    LocalRuntime,
    Outcome,
    SessionScored,
    SessionState,
    TaskRequest,
    UploadDir,
    decode,
)
from schemas import subjects as S
from services.common.bus import CLAIM_HEADER
from services.common.registry import Registry
from services.evaluator.config import EvaluatorConfig
from services.evaluator.handlers import EvaluatorService
from services.evaluator.main import consumers
from services.node.session import node_runtime
from services.runtimes.prepare import run_prepare
from tests.helpers.procs import ServiceProcess
from tests.unit.evaluators import calc_repo
from tests.unit.evaluators.sessions import (
    announce,
    delivered,
    new_sessions,
    remove_built,
    unscored,
)

pytestmark = pytest.mark.asyncio
P = "tests.unit.evaluators.plugins"


@pytest.fixture
async def registry(redis_client):
    return Registry(redis_client)  # no state events: other suites read polar.events.*


@pytest.fixture
def config(state_dir) -> EvaluatorConfig:
    return EvaluatorConfig(
        work_dir=str(state_dir / "evwork"), retry_delay_seconds=0.1, stop_grace_seconds=0.2
    )


@pytest.fixture
async def service(bus, registry, config):
    return EvaluatorService(bus, registry, config)


@pytest.fixture(autouse=True)
async def _clean_work_queue(bus):
    yield
    await remove_built(bus, "ev-")


@pytest.fixture(scope="module")
def calc_src(tmp_path_factory):
    return calc_repo.write_repo(tmp_path_factory.mktemp("calc") / "repo")


@pytest.fixture(scope="module")
def fix_diff(tmp_path_factory):
    return calc_repo.fix_diff(tmp_path_factory.mktemp("diff"))


async def drain(service: EvaluatorService) -> None:
    for c in consumers(service):
        await c.run(drain=True)


def task(task_id: str, n: int = 1, evaluator: EvaluatorSpec | None = None, **kw) -> TaskRequest:
    return TaskRequest(
        task_id=task_id,
        instruction="fix add",
        num_samples=n,
        evaluator=evaluator or EvaluatorSpec(),
        **kw,
    )


def calc_runtime(src) -> LocalRuntime:
    return LocalRuntime(prepare=[UploadDir(src=str(src))])


def calc_tests_spec(runtime="fresh", **config) -> EvaluatorSpec:
    cfg = {
        "test_command": calc_repo.TEST_COMMAND,
        "env": calc_repo.TEST_ENV,
        "expected": calc_repo.EXPECTED_FIXED,
        **config,
    }
    return EvaluatorSpec(name="test_on_output", runtime=runtime, config=cfg, timeout_seconds=60)


async def one(bus, task_id: str):
    (t,) = await delivered(bus, task_id)
    return t


async def test_session_completed_rewards_by_outcome_and_exactly_once(bus, registry, service):
    sids = await new_sessions(registry, task("ev-basic", 3))
    cases = [(Outcome.COMPLETED, True), (Outcome.TIMEOUT, True), (Outcome.ERROR, False)]
    scored = await bus.nc.subscribe(S.SESSIONS_SCORED)
    for sid, (outcome, intact) in zip(sids, cases, strict=True):
        await announce(bus, unscored(sid, "ev-basic", outcome, intact=intact))
    await drain(service)
    got = {t.session_id: t for t in await delivered(bus, "ev-basic")}
    assert len(got) == 3
    assert [got[s].reward for s in sids] == [1.0, 0.0, 0.0]
    assert [got[s].traces[0].reward for s in sids] == [1.0, 0.0, 0.0]
    assert got[sids[2]].traces[0].loss_mask == [0, 0, 0, 0]  # not intact: stays masked
    assert got[sids[1]].eval_reason == "session ended timeout: reward 0 by rule"
    assert all(t.eval_status == "ok" and t.metadata["num_samples"] == 3 for t in got.values())
    assert sorted(t.metadata["sample_index"] for t in got.values()) == [0, 1, 2]
    states = [(s.state, s.reward) for s in await registry.task_sessions("ev-basic")]
    assert states == [
        (SessionState.COMPLETED, 1.0),
        (SessionState.TIMEOUT, 0.0),
        (SessionState.ERROR, 0.0),
    ]
    events = [decode((await scored.next_msg(timeout=5)).data, SessionScored) for _ in sids]
    assert sorted(e.reward for e in events) == [0.0, 0.0, 1.0]
    await scored.unsubscribe()

    # The same TrajectoryBuilt again (past the sessions stream's dedupe): nothing new.
    for sid in sids:
        await announce(bus, unscored(sid, "ev-basic"), msg_id=f"again:{sid}")
    await drain(service)
    assert len(await delivered(bus, "ev-basic")) == 3
    assert await registry.redis.keys("polar:eval:ev-basic-*") == []


async def test_a_built_session_the_builder_has_not_advanced_is_advanced_here(
    bus, registry, service
):
    # The builder announces, then moves BUILDING -> EVALUATING; a registry outage can hold
    # that move back for longer than any retry budget (the kill -9 chaos test: 10 retries
    # of 0.25 s ran out during a 5 s Valkey outage, the message was dead-lettered and the
    # session stayed EVALUATING for good once the builder's move landed).
    (sid,) = await new_sessions(
        registry, task("ev-wait"), to=("INITIALIZING", "READY", "RUNNING", "POSTRUN", "BUILDING")
    )
    await announce(bus, unscored(sid, "ev-wait"))
    await drain(service)
    assert (await one(bus, "ev-wait")).reward == 1.0
    assert (await registry.get_session(sid)).state == SessionState.COMPLETED
    late = await registry.transition(sid, SessionState.EVALUATING, from_=[SessionState.BUILDING])
    assert not late.ok  # the builder's own move, when it lands, changes nothing


@pytest.mark.parametrize(
    ("name", "cfg", "reason"),
    [
        (f"{P}:Crashing", {}, f"evaluator '{P}:Crashing' raised ValueError: grader exploded"),
        (f"{P}:Sleeping", {"sleep": 30}, f"evaluator '{P}:Sleeping' timed out after 0.5s"),
        (
            f"{P}:Nope",
            {},
            f"custom evaluator '{P}:Nope': module 'tests.unit.evaluators.plugins' has no callable 'Nope'",
        ),
        ("no_such_module_q:Grader", {}, "cannot import module 'no_such_module_q'"),
        ("command", {"reward_from": "stdout"}, "config `command` must be a command line"),
    ],
)
async def test_failures_are_explicit_errors(bus, registry, service, name, cfg, reason):
    task_id = f"ev-fail-{random.randrange(10**9)}"
    spec = EvaluatorSpec(name=name, config=cfg, timeout_seconds=0.5)
    (sid,) = await new_sessions(registry, task(task_id, evaluator=spec))
    await announce(bus, unscored(sid, task_id))
    await drain(service)
    t = await one(bus, task_id)
    assert (t.eval_status, t.reward, t.traces[0].reward) == ("error", None, None)
    assert reason in t.eval_reason
    s = await registry.get_session(sid)
    assert s.state == SessionState.COMPLETED and s.reward is None
    assert s.reason.startswith("evaluator error: ") and reason in s.reason


async def test_test_on_output_fresh_runtime_applies_the_diff(
    bus, registry, service, calc_src, fix_diff
):
    t_fix = task("ev-toofix", evaluator=calc_tests_spec(), runtime=calc_runtime(calc_src))
    (sid,) = await new_sessions(registry, t_fix)
    await announce(bus, unscored(sid, "ev-toofix"), artifacts=Artifacts(diff=fix_diff))
    t_none = task(
        "ev-toonone", evaluator=calc_tests_spec(match="fraction"), runtime=calc_runtime(calc_src)
    )
    (sid2,) = await new_sessions(registry, t_none)
    await announce(bus, unscored(sid2, "ev-toonone"))  # the agent changed nothing
    await drain(service)

    fixed = await one(bus, "ev-toofix")
    assert (fixed.eval_status, fixed.reward) == ("ok", 1.0), fixed.eval_reason
    d = fixed.metadata["eval_details"]
    assert d["applied"] == "diff" and d["tests_matched"] == 3 and d["mismatches"] == {}
    unchanged = await one(bus, "ev-toonone")
    assert unchanged.eval_status == "ok" and unchanged.reward == pytest.approx(2 / 3)
    assert unchanged.metadata["eval_details"]["mismatches"] == {
        "test_calc.py::test_add": {"expected": "PASSED", "actual": "FAILED"}
    }
    sessions_dir = service.config.work_dir + "/sessions"
    assert not list_dir(sessions_dir, sid) and not list_dir(sessions_dir, sid2)


def list_dir(root: str, sid: str) -> list[str]:
    from pathlib import Path

    p = Path(root)
    return sorted(x.name for x in p.iterdir() if x.name.startswith(sid)) if p.exists() else []


async def test_a_diff_that_does_not_apply_is_an_error(bus, registry, service, calc_src, fix_diff):
    bad = fix_diff.replace("return a - b", "return a - b - 0")
    t = task("ev-baddiff", evaluator=calc_tests_spec(), runtime=calc_runtime(calc_src))
    (sid,) = await new_sessions(registry, t)
    await announce(bus, unscored(sid, "ev-baddiff"), artifacts=Artifacts(diff=bad))
    await drain(service)
    got = await one(bus, "ev-baddiff")
    assert got.eval_status == "error" and got.reward is None
    assert "the session's diff does not apply" in got.eval_reason
    assert "calc.py" in got.eval_reason  # git's own words name the file


async def test_no_parseable_results_is_an_error(bus, registry, service, calc_src):
    spec = calc_tests_spec(test_command="echo all good")
    t = task("ev-noparse", evaluator=spec, runtime=calc_runtime(calc_src))
    (sid,) = await new_sessions(registry, t)
    await announce(bus, unscored(sid, "ev-noparse"))
    await drain(service)
    got = await one(bus, "ev-noparse")
    assert got.eval_status == "error"
    assert "no test results in the test command's output (exit 0): all good" in got.eval_reason


async def live_runtime(config, spec: LocalRuntime, sid: str, fixed: bool = True):
    """What the executor leaves for a live evaluation: the prepared runtime, changed by
    the agent, still running."""
    rt = node_runtime(config, spec, sid, attempt=0)
    await rt.start()
    assert all(a.ok for a in await run_prepare(rt, spec.prepare))
    if fixed:
        await rt.upload_file("calc.py", calc_repo.FIXED.encode())
    return rt


async def test_test_on_output_in_the_live_runtime_then_stops_it(bus, registry, service, calc_src):
    t = task("ev-live", evaluator=calc_tests_spec("live"), runtime=calc_runtime(calc_src))
    (sid,) = await new_sessions(registry, t)
    rt = await live_runtime(service.config, t.runtime, sid)
    assert list_dir(service.config.work_dir + "/sessions", sid) == [rt.runtime_id]
    await announce(bus, unscored(sid, "ev-live"), eval_runtime_id=rt.runtime_id)
    await drain(service)
    got = await one(bus, "ev-live")
    assert (got.eval_status, got.reward) == ("ok", 1.0), got.eval_reason
    assert got.metadata["eval_details"]["applied"] == "none"
    assert list_dir(service.config.work_dir + "/sessions", sid) == []  # stopped and removed


async def test_prewarmed_fresh_runtime_is_adopted(bus, registry, service, calc_src, fix_diff):
    spec = EvaluatorSpec(name=f"{P}:WorkdirProbe", runtime="fresh", prewarm=True)
    t = task("ev-prewarm", evaluator=spec, runtime=calc_runtime(calc_src))
    (sid,) = await new_sessions(registry, t)
    rt = await live_runtime(service.config, t.runtime, sid, fixed=False)
    await rt.upload_file("PREWARMED", b"1")  # a mark: only the prewarmed runtime has it
    await announce(bus, unscored(sid, "ev-prewarm"), eval_runtime_id=rt.runtime_id)
    await drain(service)
    d = (await one(bus, "ev-prewarm")).metadata["eval_details"]
    assert d["kind"] == "fresh" and d["prewarmed"] is True and d["runtime_id"] == rt.runtime_id
    assert "PREWARMED" in d["files"] and "calc.py" in d["files"]
    assert list_dir(service.config.work_dir + "/sessions", sid) == []


async def test_live_wanted_but_not_kept_falls_back_to_fresh(
    bus, registry, service, calc_src, fix_diff
):
    t = task("ev-nolive", evaluator=calc_tests_spec("live"), runtime=calc_runtime(calc_src))
    (sid,) = await new_sessions(registry, t)
    await announce(bus, unscored(sid, "ev-nolive"), artifacts=Artifacts(diff=fix_diff))
    await drain(service)
    got = await one(bus, "ev-nolive")
    assert got.reward == 1.0, got.eval_reason
    assert got.metadata["eval_details"]["runtime"] == "fresh: the live runtime was not kept"
    assert got.metadata["eval_details"]["applied"] == "diff"


async def test_command_evaluator_stdout_and_json_file(bus, registry, service, calc_src):
    py = sys.executable
    by_stdout = EvaluatorSpec(
        name="command",
        runtime="live",
        config={"command": f"{py} -c 'import calc; print(\"scoring\"); print(calc.add(1, 1) / 4)'"},
    )
    by_file = EvaluatorSpec(
        name="command",
        runtime="live",
        config={
            "command": [
                py,
                "-c",
                "import json; json.dump({'score': {'total': 0.25}}, open('out.json', 'w'))",
            ],
            "reward_from": "json_file",
            "json_path": "out.json",
            "json_key": "score.total",
        },
    )
    for task_id, spec in (("ev-cmd-out", by_stdout), ("ev-cmd-json", by_file)):
        t = task(task_id, evaluator=spec, runtime=calc_runtime(calc_src))
        (sid,) = await new_sessions(registry, t)
        rt = await live_runtime(service.config, t.runtime, sid)
        await announce(bus, unscored(sid, task_id), eval_runtime_id=rt.runtime_id)
    await drain(service)
    out = await one(bus, "ev-cmd-out")
    assert (out.eval_status, out.reward) == ("ok", 0.5), out.eval_reason
    assert (await one(bus, "ev-cmd-json")).reward == 0.25


async def test_swebench_grading_in_a_fresh_runtime(bus, registry, service, calc_src, fix_diff):
    pytest.importorskip("swebench")
    spec = EvaluatorSpec(
        name="swebench",
        runtime="fresh",
        config={"instance": calc_repo.swebench_instance()},
        timeout_seconds=120,
    )
    for task_id, diff in (("ev-swe-fix", fix_diff), ("ev-swe-none", "")):
        t = task(task_id, evaluator=spec, runtime=calc_runtime(calc_src))
        (sid,) = await new_sessions(registry, t)
        await announce(bus, unscored(sid, task_id), artifacts=Artifacts(diff=diff))
    await drain(service)
    fixed = await one(bus, "ev-swe-fix")
    assert (fixed.eval_status, fixed.reward) == ("ok", 1.0), fixed.eval_reason
    d = fixed.metadata["eval_details"]
    assert d["resolution"] == "RESOLVED_FULL" and d["instance_id"] == "calc__calc-1"
    assert d["fail_to_pass"] == {"success": ["test_calc.py::test_add"], "failure": []}
    unfixed = await one(bus, "ev-swe-none")
    assert (unfixed.eval_status, unfixed.reward) == ("ok", 0.0)
    assert unfixed.eval_reason == "swebench: RESOLVED_NO"


async def test_large_trajectory_goes_by_claim_check(bus, registry, service):
    (sid,) = await new_sessions(registry, task("ev-large"))
    big = unscored(sid, "ev-large", tokens=120_000)  # ~1.5 MB of JSON
    await announce(bus, big)
    await drain(service)
    msg = await bus.js.get_msg(
        S.STREAM_TRAJECTORIES, 1, subject=S.trajectories("ev-large"), next=True
    )
    assert msg.headers[CLAIM_HEADER] and not msg.data
    got = await one(bus, "ev-large")
    assert got.traces[0].response_ids == big.traces[0].response_ids and got.reward == 1.0


@pytest.mark.slow
async def test_kill_9_mid_run_every_trajectory_arrives_exactly_once(
    bus, registry, nats_url, redis_url, state_dir
):
    """100 sessions; the service process is killed with SIGKILL at random moments,
    three times, and restarted; each session's trajectory is on the subject once."""
    n, task_id = 100, "ev-kill9"
    spec = EvaluatorSpec(name=f"{P}:Jitter", config={"max_sleep": 0.3})
    sids = await new_sessions(registry, task(task_id, n, evaluator=spec))
    for sid in sids:
        await announce(bus, unscored(sid, task_id))
    cfg = {
        "nats_url": nats_url,
        "redis_url": redis_url,
        "work_dir": str(state_dir / "evwork-kill"),
        "ack_wait_seconds": 1.0,
        "concurrency": 4,
    }
    proc = ServiceProcess("services.evaluator.main:create_app", cfg, state_dir / "logs")
    rng = random.Random(7)
    kills = 0
    try:
        while kills < 3:
            proc.start()
            await asyncio.sleep(rng.uniform(0.2, 0.8))
            done = len({t.session_id for t in await delivered(bus, task_id)})
            proc.kill()
            kills += 1
            assert done < n, "the run ended before the kill: nothing was tested"
        proc.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = [s.state for s in await registry.task_sessions(task_id)]
            if all(s == SessionState.COMPLETED for s in states):
                break
            await asyncio.sleep(0.2)
    finally:
        proc.stop()
    got = await delivered(bus, task_id)
    per_session = {sid: sum(t.session_id == sid for t in got) for sid in sids}
    assert [k for k, v in per_session.items() if v != 1] == []
    assert len(got) == n and all(t.reward == 1.0 for t in got)
    assert {s.state for s in await registry.task_sessions(task_id)} == {SessionState.COMPLETED}
    assert await registry.redis.keys(f"polar:eval:{task_id}-*") == []


async def test_builder_hands_the_artifacts_to_the_evaluator(
    bus, registry, service, calc_src, fix_diff
):
    """SessionFinished (diff as the executor collects it) -> the real builder ->
    TrajectoryBuilt -> test_on_output in a fresh runtime."""
    from schemas import SessionFinished, encode
    from services.builder.config import BuilderConfig
    from services.builder.handlers import Builder
    from services.builder.main import consumers as builder_consumers

    t = task("ev-handoff", evaluator=calc_tests_spec(), runtime=calc_runtime(calc_src))
    to_postrun = ("INITIALIZING", "READY", "RUNNING", "POSTRUN")
    (sid,) = await new_sessions(registry, t, to=to_postrun)
    finished = SessionFinished(
        session_id=sid,
        task_id="ev-handoff",
        outcome=Outcome.COMPLETED,
        artifacts=Artifacts(exit_code=0, diff=fix_diff, harness="shell"),
    )
    await bus.publish(S.SESSIONS_FINISHED, encode(finished), msg_id=f"finished:{sid}:0")
    for c in builder_consumers(Builder(bus, registry, BuilderConfig())):
        await c.run(drain=True)
    await drain(service)
    got = await one(bus, "ev-handoff")
    assert (got.eval_status, got.reward, got.harness) == ("ok", 1.0, "shell"), got.eval_reason
    assert got.metadata["eval_details"]["applied"] == "diff"
    assert (await registry.get_session(sid)).state == SessionState.COMPLETED


async def test_a_zero_reward_carries_the_evaluators_reason_to_session_result_and_table(
    bus, registry, service, calc_src, nats_url, redis_url
):
    """Reward 0 from test_on_output (the agent fixed nothing): the evaluator's reason is
    on the session record (``GET /sessions/{id}``), on the TaskResult the scheduler
    builds from the registry, and in ``polar submit``'s results table."""
    from litestar.testing import AsyncTestClient
    from rich.console import Console

    from schemas import TaskResult
    from services.cli.render import results_table
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.handlers import Scheduler
    from services.scheduler.main import create_app

    spec = calc_tests_spec()  # match: exact, so 2 of 3 is reward 0
    t = task("ev-why", evaluator=spec, runtime=calc_runtime(calc_src))
    (sid,) = await new_sessions(registry, t)
    await announce(bus, unscored(sid, "ev-why"))  # the agent changed nothing
    await drain(service)
    scored = await one(bus, "ev-why")
    assert (scored.eval_status, scored.reward) == ("ok", 0.0)
    why = scored.eval_reason
    assert why == "2/3 tests as expected"

    cfg = SchedulerConfig(nats_url=nats_url, redis_url=redis_url, read_token="read-ev-why")
    async with AsyncTestClient(create_app(cfg)) as client:
        read = {"authorization": "Bearer read-ev-why"}
        record = (await client.get(f"/sessions/{sid}", headers=read)).json()
    assert record["state"] == "COMPLETED" and record["reward"] == 0.0
    assert (record["eval_status"], record["eval_reason"]) == ("ok", why)

    result_sub = await bus.nc.subscribe(S.task_result("ev-why"))
    assert await Scheduler(bus, registry, cfg).maybe_finish("ev-why")
    result = decode((await result_sub.next_msg(timeout=5)).data, TaskResult)
    await result_sub.unsubscribe()
    (row,) = result.sessions
    assert (row.reward, row.reason, row.eval_reason) == (0.0, None, why)

    console = Console(width=200, record=True)
    console.print(results_table(result))
    line = next(x for x in console.export_text().splitlines() if sid in x)
    assert "COMPLETED" in line and "0 " in line and why in line


# -- node-affine evaluation (issue 20): a runtime left on a node is evaluated there ---
def node_config(state_dir, node: str, **kw) -> EvaluatorConfig:
    return EvaluatorConfig(
        node=node,
        work_dir=str(state_dir / f"evwork-{node}"),
        retry_delay_seconds=0.1,
        stop_grace_seconds=0.2,
        **kw,
    )


async def test_each_node_evaluates_the_live_runtimes_it_holds(bus, registry, state_dir, calc_src):
    """Two gateway nodes with their own work dirs, a session each whose live runtime the
    executor left there: whichever evaluator drains first, each session is evaluated in
    its own live runtime (one shared queue sent node g1's session to g2's evaluator,
    where its runtime directory is not: "fresh: the live runtime was not kept")."""
    g1 = EvaluatorService(bus, registry, node_config(state_dir, "g1"))
    g2 = EvaluatorService(bus, registry, node_config(state_dir, "g2"))
    t = task("ev-nodes", n=2, evaluator=calc_tests_spec("live"), runtime=calc_runtime(calc_src))
    sid1, sid2 = await new_sessions(registry, t)
    for service, sid in ((g1, sid1), (g2, sid2)):
        rt = await live_runtime(service.config, t.runtime, sid)
        node = service.config.node
        await announce(bus, unscored(sid, "ev-nodes"), eval_runtime_id=rt.runtime_id, node=node)
    await drain(g2)  # g2 first: it must leave g1's session alone
    await drain(g1)
    got = {d.session_id: d for d in await delivered(bus, "ev-nodes")}
    assert set(got) == {sid1, sid2}
    for sid in (sid1, sid2):
        details = got[sid].metadata["eval_details"]
        assert got[sid].reward == 1.0 and details["applied"] == "none", details  # live, as left
        assert "runtime" not in details  # no fallback note
    assert list_dir(g1.config.work_dir + "/sessions", sid1) == []  # each stopped its own
    assert list_dir(g2.config.work_dir + "/sessions", sid2) == []


async def test_a_gone_nodes_queue_is_taken_over_and_evaluated_fresh(
    bus, registry, state_dir, calc_src, fix_diff
):
    """Node g9's host is gone: its executor declared its queue and left a live runtime
    for a session, and no evaluator of g9's will ever take it. Another node's evaluator
    sees the queue hold work nobody takes and, after the period, evaluates it in a fresh
    runtime with the session's diff, exactly once; the session does not stay EVALUATING."""
    from services.common.bus import ensure_consumer, evaluation_queue
    from services.evaluator.main import node_consumer
    from services.evaluator.orphans import OrphanWatch

    await ensure_consumer(bus.js, S.STREAM_SESSIONS, evaluation_queue("g9"))
    g1 = EvaluatorService(bus, registry, node_config(state_dir, "g1"))
    t = task("ev-gone", evaluator=calc_tests_spec("live"), runtime=calc_runtime(calc_src))
    (sid,) = await new_sessions(registry, t)
    await announce(
        bus,
        unscored(sid, "ev-gone"),
        artifacts=Artifacts(diff=fix_diff),
        eval_runtime_id=f"{sid}-a0-main",
        node="g9",
    )
    await drain(g1)  # its own queues: g9's is not among them
    assert await delivered(bus, "ev-gone") == []

    taken = []

    async def take_over(node: str) -> None:
        taken.append(node)
        await node_consumer(g1, node).run(drain=True)

    watch = OrphanWatch(bus, g1.config.reachable_nodes, 0.3, take_over)
    await watch.poll()  # the first look
    assert taken == []
    await asyncio.sleep(0.4)
    await watch.poll()
    assert taken == ["g9"]
    (got,) = await delivered(bus, "ev-gone")
    assert got.reward == 1.0, got.eval_reason
    details = got.metadata["eval_details"]
    assert details["runtime"] == "fresh: the live runtime is on node g9, gone"
    assert (await registry.get_session(sid)).state == SessionState.COMPLETED
    await asyncio.sleep(0.4)
    await watch.poll()  # nothing left in g9's queue: nothing taken again
    assert taken == ["g9"] and len(await delivered(bus, "ev-gone")) == 1
