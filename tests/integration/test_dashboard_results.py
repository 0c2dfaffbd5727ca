"""Reading results on the dashboard (issue 38, items 10-12): real NATS, Valkey, an embedded
engine and a dashboard process of their own, seeded as the stack's services leave them:

- a task whose first session failed (its harness's `./agent.sh: not found`, in colour on
  stderr, then the evaluator's `reward 0 by rule`) and whose second passed (reward 1.0 on
  the copy delivered on the trajectories stream, none on the builder's in the object
  store; a title side call made before its main loop);
- more tasks than the overview's page of 20;
- a trainer log whose run is done, with clip fraction, KL and gradient norm;
- a stack record whose only engine is the embedded ``model`` service (no ``backends``).

The JSON API is read as a client reads it, then the same pages in headless chromium.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import httpx
import orjson
import pytest

from evaluators import EvalResult
from infra.stackstate import Proc, StackState, write_state
from schemas import Artifacts, BuilderSpec, Outcome, SessionFinished, encode
from schemas import SessionState as ST
from schemas import subjects as S
from services.builder.logic import build_trajectory
from services.builder.strategies import default_registry
from services.common.bus import Bus
from services.common.registry import Registry
from services.evaluator.logic import score, trajectory_msg_id
from tests.helpers.browser import CHROMIUM, DRIVER, minted_sign_in_url, new_browser
from tests.helpers.stack import EmbeddedServer, lone_dashboard, running_session
from tests.unit.builder.synth import Capture, agent_loop, opening, text
from tests.unit.engine.tiny import tiny_model_dir

pytestmark = [pytest.mark.timeout(300)]

READ, ADMIN = "pr_results-read", "pa_results-admin"
TASK = "res-calc"
BULK = 25  # tasks besides it: more than a page
NOT_FOUND = "shell exited with code 127: sh: 1: ./agent.sh: not found"
RULE = "session ended error: reward 0 by rule"
STDERR = "\x1b[33mwarning\x1b[0m: no config\nsh: 1: ./agent.sh: \x1b[1;31mnot found\x1b[0m\n"
TRAINER_LOG = [
    {"type": "eval", "step": 0, "accuracy": 0.1},
    *(
        {
            "type": "step",
            "step": s,
            "reward_mean": 0.2 * s,
            "loss": 1.0 / s,
            "staleness": {"0": 4},
            "mismatch_max": 1e-6,
            "clip_fraction": 0.05 * s,
            "kl": 0.01 * s,
            "grad_norm": 2.0 / s,
        }
        for s in (1, 2, 3)
    ),
    {"type": "eval", "step": 3, "accuracy": 0.7},
    {"type": "done", "step": 3},
]


async def fail(reg: Registry, bus: Bus, sid: str) -> None:
    """As the executor leaves a harness that could not start, and the evaluator its rule."""
    assert (await reg.transition(sid, ST.POSTRUN, outcome="error", reason=NOT_FOUND)).ok
    art = Artifacts(exit_code=127, stderr_tail=STDERR, harness="shell")
    done = SessionFinished(
        session_id=sid, task_id=TASK, outcome=Outcome.ERROR, reason=NOT_FOUND, artifacts=art
    )
    await bus.publish(S.SESSIONS_FINISHED, encode(done))
    for state in (ST.BUILDING, ST.EVALUATING):
        assert (await reg.transition(sid, state)).ok
    final = await reg.transition(sid, ST.ERROR, eval_status="ok", eval_reason=RULE, reward=0.0)
    assert final.ok


async def succeed(reg: Registry, bus: Bus, sid: str) -> None:
    """As the proxy, builder and evaluator leave a passed session: its records, the built
    trajectory (no reward) in the object store, the scored one delivered."""
    rng, cap = random.Random(5), Capture(sid)
    cap.call(opening(text(rng, 12), text(rng, 8)), text(rng, 4) + [2], side_call="title")
    agent_loop(cap, rng, 2)
    for rec in cap.records:
        await bus.js.publish(S.completions(sid), encode(rec))
    assert (await reg.transition(sid, ST.POSTRUN, outcome="completed")).ok
    art = Artifacts(exit_code=0, stdout_tail="\x1b[32mall tests passed\x1b[0m", harness="shell")
    done = SessionFinished(session_id=sid, task_id=TASK, outcome=Outcome.COMPLETED, artifacts=art)
    await bus.publish(S.SESSIONS_FINISHED, encode(done))
    assert (await reg.transition(sid, ST.BUILDING)).ok
    built = build_trajectory(
        done, BuilderSpec(name="prefix_merging"), cap.records, default_registry()
    )
    await (await bus.blobs()).put(S.trajectory_object(sid, 0), encode(built))
    assert (await reg.transition(sid, ST.EVALUATING)).ok
    scored = score(built, EvalResult.ok(1.0, "tests passed"), num_samples=2, index=1)
    await bus.publish(S.trajectories(TASK), encode(scored), msg_id=trajectory_msg_id(sid, 0))
    final = await reg.transition(
        sid, ST.COMPLETED, eval_status="ok", eval_reason="tests passed", reward=1.0
    )
    assert final.ok


async def seed(cfg: dict) -> tuple[str, str]:
    bus = await Bus.open(cfg["nats_url"], "dash-results-seed")
    reg = Registry.from_url(cfg["redis_url"], publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    try:
        for i in range(BULK):
            await running_session(reg, f"res-bulk-{i:02d}")
        failed, passed = await running_session(reg, TASK, n=2)
        await fail(reg, bus, failed.session_id)
        await succeed(reg, bus, passed.session_id)
        return failed.session_id, passed.session_id
    finally:
        await reg.close()
        await bus.close()


def until(check: Callable[[], object], what: str, timeout: float = 60.0):
    """``check()``'s first truthy answer (the dashboard follows the events as they come)."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return got


@pytest.fixture(scope="module")
def dash(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash-results")
    engine = EmbeddedServer(tiny_model_dir(), log_dir=tmp / "logs").wait()
    try:
        model = Proc(
            name="model",
            pid=None,
            start_ticks=None,
            url=engine.url,
            port=engine.port,
            started=False,
        )
        write_state(StackState(state_dir=str(tmp), created_at=time.time(), procs=[model]))
        log = tmp / "log.jsonl"
        log.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in TRAINER_LOG))
        extra = {"admin_token": ADMIN, "state_dir": str(tmp), "trainer_log": str(log)}
        with lone_dashboard(tmp, READ, streams=True, **extra) as lone:
            client = httpx.Client(
                base_url=lone.dash.url, headers={"authorization": f"Bearer {READ}"}, timeout=30
            )
            # following the events (and subscribed to the finished sessions' artifacts)
            until(lambda: client.get("/api/overview").json()["problems"] == [], "the dashboard")
            failed, passed = asyncio.run(seed(lone.config))
            until(lambda: client.get(f"/api/tasks/{TASK}").json()["settled"], "the task to settle")
            yield lone, client, failed, passed
            client.close()
    finally:
        engine.stop()


def test_a_failed_session_shows_its_harness_error_where_listed_and_on_its_page(dash):
    """Issue 38.10: listed everywhere as `session ended error: reward 0 by rule`."""
    _, client, failed, _ = dash
    rows = client.get("/api/sessions", params={"task": TASK}).json()["page"]["rows"]
    assert [r["cause"] for r in rows] == [NOT_FOUND, "tests passed"]
    assert rows[0]["exit_code"] == 127
    assert rows[0]["stderr"] == "warning: no config\nsh: 1: ./agent.sh: not found"
    group = client.get(f"/api/tasks/{TASK}").json()["group"]
    assert [m["reason"] for m in group] == [NOT_FOUND, "tests passed"]
    page = client.get(f"/api/sessions/{failed}").json()
    assert page["failure"] == {
        "state": "ERROR",
        "reason": NOT_FOUND,
        "eval_reason": RULE,
        "exit_code": 127,
        "stderr": "warning: no config\nsh: 1: ./agent.sh: not found",  # no escapes
        "artifacts": True,
    }
    assert page["artifacts"]["stderr_tail"]["text"] == page["failure"]["stderr"] + "\n"


def test_the_stored_trajectory_shows_the_delivered_reward(dash):
    """Issue 38.11: the stored view read the builder's copy (no reward: `reward –`) while
    the trainer and the export got 1.0."""
    _, client, _, passed = dash
    view = client.get(f"/api/sessions/{passed}/trajectory", params={"view": "stored"}).json()
    assert view["note"] is None
    assert [t["reward"] for t in view["traces"]] == [1.0] * len(view["traces"])
    title = next(t for t in view["traces"] if t["side_call"] == "title")
    assert title["lineage"]["later"] is True  # made before the loop it is filed under


def test_a_wrong_token_on_cancel_is_told_the_cancel_needs_the_admin_token(dash):
    """Issue 38.11: the refusal named the read token."""
    lone, client, _, _ = dash
    for token in ("not-a-token", READ):
        r = httpx.post(
            f"{lone.dash.url}/api/tasks/{TASK}/cancel",
            headers={"authorization": f"Bearer {token}"},
            timeout=30,
        )
        assert r.status_code == 401
        detail = r.json()["detail"]
        assert detail.startswith("a cancel needs the stack's admin token"), detail
        assert detail.endswith("the bearer token is not the dashboard's admin token"), detail


def test_tasks_are_paged_the_embedded_engine_is_listed_and_training_is_labelled(dash):
    """Issue 38.12: the task list stopped at its first page; Engines and Backends were
    empty with the embedded model serving; the training page had raw keys, no clip / KL /
    gradient-norm panels and no "done"."""
    _, client, _, _ = dash
    first = client.get("/api/overview").json()["tasks"]
    assert (first["total"], first["offset"], len(first["rows"])) == (BULK + 1, 0, 20)
    rest = client.get("/api/overview", params={"offset": 20, "limit": 20}).json()["tasks"]
    assert len(rest["rows"]) == BULK + 1 - 20
    assert {r["task_id"] for r in first["rows"] + rest["rows"]} == {
        TASK,
        *(f"res-bulk-{i:02d}" for i in range(BULK)),
    }
    engines = until(
        lambda: [e for e in client.get("/api/overview").json()["engines"] if e["up"]],
        "the embedded engine's queue",
    )
    assert engines == [
        {"name": "model", "kind": "embedded", "url": engines[0]["url"], "queue": 0.0, "up": True}
    ]
    assert client.get("/api/topology").json()["backends"][0]["name"] == "model"
    training = client.get("/api/training").json()
    assert (training["state"], training["last_step"]) == ("done", 3)
    assert training["labels"]["heldout_accuracy"] == "held-out accuracy"
    assert training["curves"]["grad_norm"] == [[1, 2.0], [2, 1.0], [3, 2.0 / 3]]
    assert {"clip_fraction", "kl"} <= set(training["curves"])


@pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs chromium and chromium-driver")
def test_the_pages_show_it_in_a_browser(dash):
    from tests.integration.test_dashboard_browser import By, goto, shot, texts, wait

    lone, _, failed, passed = dash
    url = lone.dash.url
    d = new_browser()
    try:
        goto(d, minted_sign_in_url(url, READ))
        wait(d, lambda d: d.find_elements(By.ID, "tasks-pager"))
        assert d.find_element(By.ID, "tasks-range").text == f"1–20 of {BULK + 1}"
        d.find_element(By.ID, "tasks-next").click()
        wait(d, lambda d: d.find_element(By.ID, "tasks-range").text == f"21–26 of {BULK + 1}")
        wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, f'#tasks-table tr[data-task="{TASK}"]'))
        wait(d, lambda d: "model" in d.find_element(By.CSS_SELECTOR, "main").text)  # engines
        shot(d, "overview-paged")

        goto(d, f"{url}/tasks/{TASK}")
        wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "#timeline-axis .tick"))
        assert texts(d, "#timeline-axis .tick")[0] == "0"
        wait(d, lambda d: texts(d, "#group-table td.reason") == [NOT_FOUND, "tests passed"])
        wait(d, lambda d: NOT_FOUND in texts(d, "#sessions-table td.reason"))
        shot(d, "task-failed")

        goto(d, f"{url}/sessions/{failed}")
        wait(d, lambda d: d.find_elements(By.ID, "failure-reason"))
        assert d.find_element(By.ID, "failure-reason").text == NOT_FOUND
        assert d.find_element(By.ID, "failure-exit").text == "exit code 127"
        stderr = d.find_element(By.ID, "failure-stderr").text
        assert stderr.endswith("sh: 1: ./agent.sh: not found") and "\x1b" not in stderr
        assert "[33m" not in d.find_element(By.ID, "stderr").text
        shot(d, "session-failed")

        goto(d, f"{url}/sessions/{passed}/trajectory")
        wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, ".trace .chain-meta"))
        metas = texts(d, ".trace .chain-meta")
        assert all(" · reward 1 · " in m for m in metas), metas
        assert any("made before the main loop" in m for m in metas), metas
        shot(d, "trajectory-delivered")

        goto(d, f"{url}/training")
        wait(d, lambda d: d.find_elements(By.ID, "train-state"))
        assert d.find_element(By.ID, "train-state").text == "done at step 3"
        captions = texts(d, "figure figcaption")
        assert any(c.startswith("held-out accuracy: ") for c in captions), captions
        assert not any(c.startswith("heldout_accuracy") for c in captions), captions
        for key in ("clip_fraction", "kl", "grad_norm"):
            assert d.find_elements(By.CSS_SELECTOR, f'figure[data-curve="{key}"] circle.dot')
        shot(d, "training-done")
    finally:
        d.quit()
