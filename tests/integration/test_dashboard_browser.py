"""The dashboard in a real headless browser (Debian's chromium + chromium-driver, driven
by selenium) against a live stack running real tasks: every page renders, live updates
arrive while sessions move, the trajectory viewer shows the loss mask and a break
reason, a cancel from the UI ends a task, a harness's markup stays text, unknown ids
are 404 pages, and NATS or Redis going down gives a banner, not a crash. The browser
signs in as an operator does: the sign-in page first, then the link `polar dashboard`
prints.

Screenshots of each page go to ``$POLAR_DASHBOARD_SHOTS`` when set (docs/img/).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import pytest

from infra import credentials, devstack, localservers
from infra.topology import parse_topology
from schemas import BuilderSpec, Outcome, SessionFinished, encode
from schemas import subjects as S
from services.builder.logic import build_trajectory
from services.builder.strategies import default_registry
from services.cli.demo import demo_task, demo_topology
from services.common.bus import Bus
from services.common.registry import Registry
from tests.helpers.browser import (
    CHROMIUM,
    DRIVER,
    minted_sign_in_url,
    new_browser,
    printed_sign_in_url,
)
from tests.helpers.stack import lone_dashboard, running_session
from tests.unit.dashboard.test_views import records_with_tool_failures

pytestmark = [pytest.mark.timeout(420)]

if not (CHROMIUM and DRIVER):
    pytest.skip(
        "needs chromium and chromium-driver (`just setup` as root: apt-get install -y "
        "chromium chromium-driver)",
        allow_module_level=True,
    )
webdriver = pytest.importorskip(
    "selenium.webdriver", reason="needs selenium (pip install selenium)"
)
from selenium.common.exceptions import (  # noqa: E402
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

SHOTS = os.environ.get("POLAR_DASHBOARD_SHOTS")
EVIL = '<script>window.__polar_xss=1</script><img src=x onerror="window.__polar_xss=2"><b id="evil">markup</b>'

# An agent of two conversations (a different system prompt each: prefix_merging makes two
# chains, the second with break reason sub_agent) whose output is all markup.
TWO_CHAIN_AGENT = f"""
import json, os, urllib.request
EVIL = {EVIL!r}
def chat(messages):
    body = json.dumps({{"model": "polar-tiny", "max_tokens": 16, "messages": messages}})
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=body.encode(), headers={{"content-type": "application/json",
        "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["message"]
# one conversation of two turns (the second prompt extends the first: its new user turn
# is masked), then a sub-agent with its own system prompt (a new chain)
main = [{{"role": "system", "content": "You are the main agent. " + EVIL}},
        {{"role": "user", "content": "Say hi. " + EVIL}}]
reply = chat(main)
chat(main + [{{"role": "assistant", "content": reply.get("content") or ""}},
             {{"role": "user", "content": "Again. " + EVIL}}])
chat([{{"role": "system", "content": "You are a sub-agent."}}, {{"role": "user", "content": "Summarize."}}])
open("evil.html", "w").write(EVIL)
print(EVIL)
"""


def markup_task(task_id: str) -> dict:
    return {
        "task_id": task_id,
        "instruction": f"Print some markup {EVIL}",
        "num_samples": 1,
        "timeout_seconds": 300,
        "runtime": {
            "backend": "local",
            "prepare": [{"action": "upload_file", "content": TWO_CHAIN_AGENT, "dest": "agent.py"}],
        },
        "agent": {
            "harness": "shell",
            "command": f"{sys.executable} agent.py",
            "model": "polar-tiny",
            "collect_diff": True,  # session_completed reads none: shown on the page
        },
        "builder": {"name": "prefix_merging"},
    }


def slow_task(task_id: str) -> dict:
    return {
        "task_id": task_id,
        "instruction": "wait",
        "num_samples": 2,
        "timeout_seconds": 600,
        "runtime": {"backend": "local"},
        "agent": {"harness": "shell", "command": "sleep 300"},
    }


def admin_token(topo) -> str:
    """The token `polar up` generated for this stack (and handed the dashboard)."""
    creds = credentials.load(Path(topo.state_dir))
    assert creds is not None
    return creds.admin_token


def reader(topo) -> dict[str, str]:
    """The stack's read token as a bearer token: what an API client sends."""
    creds = credentials.load(Path(topo.state_dir))
    assert creds is not None
    return {"authorization": f"Bearer {creds.read_token}"}


@pytest.fixture(scope="module")
def stack():
    state_dir = Path(tempfile.mkdtemp(prefix="polar-dash-"))
    topology = state_dir / "topology.yaml"  # for `polar dashboard`, as an operator has it
    topology.write_text(demo_topology(state_dir))
    topo = parse_topology(topology.read_text(), "dashboard topology")
    devstack.up(topo)
    yield topo, f"http://127.0.0.1:{topo.services['dashboard'].port}"
    devstack.down(state_dir)


def sign_in(driver, url: str, link: str) -> None:
    """What an operator sees first (the sign-in page), then the printed link: the page
    it opens is the overview, at the clean URL, signed in."""
    goto(driver, url + "/")
    wait(driver, lambda d: d.find_elements(By.ID, "sign-in"))
    assert "polar dashboard" in driver.find_element(By.ID, "main").text
    goto(driver, link)
    wait(driver, lambda d: d.find_elements(By.ID, "n-sessions"))
    assert driver.current_url == url + "/"  # the ticket is not left in the address bar


@pytest.fixture(scope="module")
def browser(stack):
    topo, url = stack
    driver = new_browser()
    sign_in(driver, url, printed_sign_in_url(Path(topo.state_dir) / "topology.yaml"))
    yield driver
    driver.quit()


def wait(driver, what, timeout=60.0):
    """Until ``what`` holds; live pages re-render, so an element read mid-render is read
    again."""
    gone = (StaleElementReferenceException, NoSuchElementException)
    try:
        return WebDriverWait(driver, timeout, 0.2, ignored_exceptions=gone).until(what)
    except TimeoutException:
        b = driver.find_element(By.TAG_NAME, "body")
        state = {
            k: b.get_attribute(f"data-{k}") for k in ("rendered", "live-version", "reconnects")
        }
        name = "".join(c if c.isalnum() else "-" for c in driver.current_url.split("/", 3)[-1])
        driver.save_screenshot(str(Path(tempfile.gettempdir()) / f"dashboard-timeout-{name}.png"))
        for entry in driver.get_log("browser"):
            print("browser:", entry)
        raise AssertionError(f"timed out on {driver.current_url}: {state}") from None


def goto(driver, url: str) -> None:
    """Open ``url``; again when chromium saw the host's network change mid-load (podman
    adding interfaces for other tests: ERR_NETWORK_CHANGED, nothing of the dashboard)."""
    for _ in range(3):
        driver.get(url)
        if "ERR_NETWORK_CHANGED" not in driver.page_source:
            return
        time.sleep(1)


def shot(driver, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(SHOTS) / f"dashboard-{name}.png"))


def rendered(driver) -> int:
    return int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-rendered") or 0)


async def publish(topo, *tasks: dict) -> None:
    creds = credentials.load(Path(topo.state_dir))  # the stack's NATS wants a user
    url = creds.nats_url(topo.nats_url) if creds else topo.nats_url
    bus = await Bus.open(url, "dash-test", declare=False)
    try:
        for t in tasks:
            await bus.js.publish(
                S.TASKS_SUBMIT, orjson.dumps(t), headers={"Nats-Msg-Id": t["task_id"]}
            )
    finally:
        await bus.close()


def texts(driver, css: str) -> list[str]:
    return [e.text for e in driver.find_elements(By.CSS_SELECTOR, css)]


def test_pages_render_live_against_a_running_task(stack, browser):
    topo, url = stack
    d = browser
    goto(d, url + "/")
    wait(d, lambda d: d.find_elements(By.ID, "n-sessions"))
    assert d.find_element(By.ID, "n-sessions").text == "0"
    # submitted after the page loaded: it appears and its sessions move without a reload
    asyncio.run(publish(topo, demo_task("dash-calc"), markup_task("dash-markup")))
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, 'tr[data-task="dash-calc"]'))
    first = rendered(d)
    wait(d, lambda d: rendered(d) > first)  # re-rendered on a pushed change
    goto(d, url + "/tasks/dash-calc")
    wait(d, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#timeline .tl-row")) == 4)
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "#timeline .phase.ph-running"), 120)
    shot(d, "task-live")
    # every session reaches a reward on this same page, pushed live
    wait(d, lambda d: texts(d, "#group-table td.reward") == ["1"] * 4, 300)
    wait(  # hover timings
        d,
        lambda d: any(
            "RUNNING:" in (s.get_attribute("title") or "")
            for s in d.find_elements(By.CSS_SELECTOR, "#timeline .phase")
        ),
    )
    wait(d, lambda d: d.find_element(By.ID, "no-variance"))  # all four 1.0: no advantage
    shot(d, "task")
    goto(d, url + "/")
    wait(d, lambda d: "COMPLETED" in d.find_element(By.ID, "states").text)
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "#nodes-table tr"))
    wait(d, lambda d: "POLAR_COMPLETIONS" in d.find_element(By.ID, "streams-table").text)
    shot(d, "overview")
    # the sessions table filters server-side
    d.find_element(By.ID, "f-task").send_keys("dash-calc")
    d.find_element(By.ID, "f-state").send_keys("completed")
    d.find_element(By.CSS_SELECTOR, "#filters button").click()
    wait(d, lambda d: "of 4" in d.find_element(By.ID, "sessions-range").text)

    goto(d, url + "/sessions/dash-calc-0000")
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "#calls-table tr.call"))
    calls = d.find_elements(By.CSS_SELECTOR, "#calls-table tr.call")
    assert len(calls) >= 4  # the scripted agent's turns
    assert "openai_chat" in calls[0].text
    calls[0].click()
    assert (
        "harness's request" in d.find_element(By.CSS_SELECTOR, "tr.call-detail:not([hidden])").text
    )
    wait(d, lambda d: "calc.py" in d.find_element(By.ID, "diff").text)  # the agent's fix
    assert "reward 1 " in d.find_element(By.ID, "verdict").text
    shot(d, "session")

    goto(d, url + "/sessions/dash-calc-0000/trajectory")
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, ".trace .tok"))
    assert d.find_elements(By.CSS_SELECTOR, ".trace .tok.m0") and d.find_elements(
        By.CSS_SELECTOR, ".trace .tok.m1"
    )
    title = d.find_element(By.CSS_SELECTOR, ".trace .tok.m1").get_attribute("title")
    assert "sampled" in title and "logprob -" in title
    shot(d, "trajectory")

    goto(d, url + "/training")
    wait(d, lambda d: d.find_elements(By.ID, "no-trainer"))
    goto(d, url + "/topology")
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "#services-table tr[data-service]"))
    healthy = texts(d, "#services-table td.ok")
    assert len(healthy) == 8 and set(healthy) == {"healthy"}
    shot(d, "topology")


def test_trajectory_viewer_shows_a_break_and_markup_stays_text(stack, browser):
    topo, url = stack
    d = browser
    asyncio.run(publish(topo, markup_task("dash-markup")))  # once: the task id dedupes

    async def until_ended() -> None:
        creds = credentials.load(Path(topo.state_dir))  # the stack's Valkey has a password
        reg = Registry.from_url(creds.redis_url(topo.redis_url) if creds else topo.redis_url)
        try:
            for _ in range(240):
                s = await reg.get_session("dash-markup-0000")
                if s is not None and s.state.value in ("COMPLETED", "ERROR", "TIMEOUT"):
                    return
                await asyncio.sleep(1)
        finally:
            await reg.close()

    asyncio.run(until_ended())
    goto(d, url + "/sessions/dash-markup-0000/trajectory?view=prefix_merging")
    wait(d, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".trace")) == 2)
    reasons = texts(d, ".trace .break-reason")
    assert reasons == ["first", "sub_agent"]
    lineage = texts(d, ".trace .lineage")
    assert lineage[1] == "dash-markup-0000/0"
    assert d.find_elements(By.CSS_SELECTOR, ".trace .tok.m0") and d.find_elements(
        By.CSS_SELECTOR, ".trace .tok.m1"
    )
    shot(d, "trajectory-break")
    d.find_element(By.CSS_SELECTOR, '#views a[data-view="per_request"]').click()
    wait(  # the same session, one trace per model call
        d,
        lambda d: (
            len(d.find_elements(By.CSS_SELECTOR, ".trace")) == 3 and "per_request" in d.current_url
        ),
    )

    goto(d, url + "/sessions/dash-markup-0000")
    wait(d, lambda d: EVIL in d.find_element(By.ID, "stdout").text)
    assert EVIL in d.find_element(By.ID, "diff").text
    d.find_elements(By.CSS_SELECTOR, "#calls-table tr.call")[0].click()
    # inside JSON its quotes are escaped: its script tag is there, as text
    assert (
        "<script>window.__polar_xss=1</script>"
        in d.find_element(By.CSS_SELECTOR, "tr.call-detail:not([hidden])").text
    )
    goto(d, url + "/tasks/dash-markup")
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "pre.instruction"))
    assert EVIL in d.find_element(By.CSS_SELECTOR, "pre.instruction").text
    # the markup is text: no element of its making, and its script never ran
    assert d.execute_script("return window.__polar_xss") is None
    assert not d.find_elements(By.ID, "evil")
    assert not d.find_elements(By.CSS_SELECTOR, 'img[src="x"]')


def test_cancel_from_the_ui_ends_the_task(stack, browser):
    topo, url = stack
    d = browser
    asyncio.run(publish(topo, slow_task("dash-slow")))
    # its page once the scheduler has it (before, the page is a 404 that stays one: a
    # loaded machine was slow enough for that once)
    goto(d, url + "/")
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, 'tr[data-task="dash-slow"]'), 60)
    goto(d, url + "/tasks/dash-slow")
    wait(d, lambda d: "RUNNING" in d.find_element(By.ID, "timeline").text, 120)
    d.find_element(By.ID, "cancel").click()
    d.switch_to.alert.send_keys(admin_token(topo))  # the page asks for the admin token
    d.switch_to.alert.accept()
    wait(
        d, lambda d: "cancel of dash-slow published" in d.find_element(By.ID, "cancel-result").text
    )
    wait(d, lambda d: texts(d, "#timeline .state") == ["CANCELLED", "CANCELLED"], 60)
    assert d.find_element(By.ID, "cancel").get_attribute("disabled") is not None


def quick_task(task_id: str) -> dict:
    return {
        "task_id": task_id,
        "instruction": "nothing",
        "num_samples": 1,
        "runtime": {"backend": "local"},
        "agent": {"harness": "shell", "command": "true"},
    }


def test_pages_left_for_others_let_go_of_their_live_stream(stack, browser):
    """Chromium keeps a page left for another in its back/forward cache; with its event
    stream open each held one of the six connections it gives a host, and the sixth page's
    reads waited 20 s and failed (found by tests/bench/bench_dashboard.py's page loads)."""
    topo, url = stack
    d = browser
    asyncio.run(publish(topo, quick_task("dash-nav")))
    # registered before its page is opened (a page of an unknown task says so and stays)
    wait(
        d,
        lambda _: httpx.get(url + "/api/tasks/dash-nav", headers=reader(topo)).status_code == 200,
        30,
    )
    for i in range(8):
        goto(d, url + ("/" if i % 2 else "/tasks/dash-nav"))
        wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "#sessions-table tr[data-session]"), 10)
    d.execute_script("window.__polarKept = 1")
    goto(d, url + "/topology")
    d.back()  # the overview again, from the cache: its stream opened again
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "#sessions-table"), 10)
    assert d.execute_script("return window.__polarKept") == 1  # restored, not reloaded
    asyncio.run(publish(topo, quick_task("dash-back")))
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, 'tr[data-task="dash-back"]'), 60)


def test_unknown_ids_are_404_pages_and_cancel_needs_the_admin_token(stack, browser):
    topo, url = stack
    read = reader(topo)
    for path in ("/tasks/no-such-task", "/sessions/no-such-session", "/sessions/nope/trajectory"):
        assert httpx.get(url + path, headers=read).status_code == 404
        assert httpx.get(url + path).status_code == 401  # not even whether it exists
        goto(browser, url + path)
        wait(browser, lambda d: d.find_elements(By.ID, "not-found"))
    assert httpx.get(url + "/api/sessions/nope", headers=read).status_code == 404
    assert httpx.get(url + "/api/sessions?state=SLEEPING", headers=read).status_code == 400
    forged = httpx.post(url + "/api/tasks/dash-calc/cancel")  # a harness on the host network
    assert forged.status_code == 401 and "Bearer" in forged.json()["detail"]
    wrong = httpx.post(url + "/api/tasks/dash-calc/cancel", headers={"Authorization": "Bearer no"})
    assert wrong.status_code == 401
    assert httpx.post(url + "/api/tasks/dash-calc/cancel", headers=read).status_code == 401
    for page in (httpx.get(url + "/", headers=read), httpx.get(url + "/")):  # sign-in page too
        assert "script-src 'self'" in page.headers["content-security-policy"]
    # the browser's sign-in: a cookie its scripts cannot read, sent by no other site
    cookie = next(c for c in browser.get_cookies() if c["name"].startswith("polar_dashboard_"))
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert browser.execute_script("return document.cookie") == ""


def test_nats_or_redis_down_is_a_banner_not_a_crash(tmp_path):
    with lone_dashboard(tmp_path, "pr_banner-test", streams=True) as lone:
        dash, driver = lone.dash, new_browser()
        try:
            goto(driver, minted_sign_in_url(dash.url, lone.config["read_token"]))
            wait(driver, lambda d: d.find_elements(By.ID, "n-sessions"))
            # a healthy stack shows no banner: under load a first poll may time out (and say
            # so), the next one clears it and the live stream says so at once
            wait(driver, lambda d: not d.find_element(By.ID, "banner").is_displayed(), 30)
            metrics = httpx.get(dash.url + "/metrics").text  # its own, beside every service's
            assert (
                "polar_dashboard_sessions" in metrics and "polar_dashboard_live_clients" in metrics
            )
            localservers.stop_process(lone.valkey.pid)
            wait(driver, lambda d: "cannot reach Redis" in d.find_element(By.ID, "banner").text, 30)
            localservers.stop_process(lone.nats.pid)
            wait(driver, lambda d: "NATS" in d.find_element(By.ID, "banner").text, 30)
            shot(driver, "banner")
            goto(driver, dash.url + "/")  # a fresh load still renders, with the banner
            wait(driver, lambda d: d.find_elements(By.ID, "n-sessions"))
            wait(driver, lambda d: d.find_element(By.ID, "banner").is_displayed(), 10)
            assert httpx.get(dash.url + "/healthz").status_code == 503
            assert httpx.get(dash.url + "/metrics").status_code == 200  # served while degraded
            assert dash.proc.poll() is None
        finally:
            driver.quit()


async def seed_tool_session(cfg: dict, task_id: str) -> str:
    """A RUNNING session whose calls' tool markup partly failed to parse (its records on
    the completions stream, its prefix-merged trajectory in the object store), as the
    proxy and the builder leave them; its events reach the dashboard."""
    bus = await Bus.open(cfg["nats_url"], "dash-tools-seed")
    reg = Registry.from_url(cfg["redis_url"], publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    try:
        (session,) = await running_session(reg, task_id)
        sid = session.session_id
        records = records_with_tool_failures(sid)
        for rec in records:
            await bus.js.publish(S.completions(sid), encode(rec))
        done = SessionFinished(session_id=sid, task_id=task_id, outcome=Outcome.COMPLETED)
        spec = BuilderSpec(name="prefix_merging")
        traj = build_trajectory(done, spec, records, default_registry())
        await (await bus.blobs()).put(S.trajectory_object(sid, 0), encode(traj))
        return sid
    finally:
        await reg.close()
        await bus.close()


def test_tool_call_parse_health_on_the_session_trajectory_and_task_pages(tmp_path):
    with lone_dashboard(tmp_path, "pr_tools-test", streams=True) as lone:
        sid = asyncio.run(seed_tool_session(lone.config, "dash-tools"))
        driver = new_browser()
        try:
            d = driver
            goto(d, minted_sign_in_url(lone.dash.url, lone.config["read_token"]))
            wait(d, lambda d: d.find_elements(By.ID, "n-sessions"))
            goto(d, f"{lone.dash.url}/sessions/{sid}")
            wait(d, lambda d: d.find_elements(By.ID, "tool-parse"), 30)
            line = d.find_element(By.ID, "tool-parse").text
            assert line == (
                "tool calls: 1 parsed, 2 failed (malformed ×1, unknown_tool ×1)"
                " · failed in calls 1, 2"
            )
            badges = texts(d, "#calls-table tr.call .tool-failed")
            assert badges == ["1 tool call failed", "1 tool call failed"]
            d.find_element(By.CSS_SELECTOR, '#calls-table tr.call[data-seq="1"]').click()
            detail = d.find_element(By.CSS_SELECTOR, "tr.call-detail:not([hidden])")
            assert "tool calls: 0 parsed, 1 failed (malformed ×1)" in detail.text
            assert "malformed — Expecting value · output tokens [2, 5)" in detail.text
            shot(d, "session-tool-parse")

            goto(d, f"{lone.dash.url}/sessions/{sid}/trajectory")
            wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, ".trace .tool-parse"), 30)
            meta = d.find_element(By.CSS_SELECTOR, ".trace .tool-parse").text
            assert meta == "tool calls: 1 parsed, 2 failed (malformed ×1, unknown_tool ×1)"
            failures = texts(d, ".trace .tool-failure")
            assert failures[0].startswith("call 1: malformed — Expecting value · response tokens [")
            assert failures[1] == "call 2: unknown_tool — no tool named 'rm' · the whole call"
            marked = d.find_elements(By.CSS_SELECTOR, ".trace .tok.tf")
            assert len(marked) == 3  # the broken call's three tokens, outlined
            assert "tool call failed: malformed" in marked[0].get_attribute("title")
            shot(d, "trajectory-tool-parse")

            goto(d, f"{lone.dash.url}/tasks/dash-tools")
            wait(d, lambda d: d.find_elements(By.ID, "tool-parse"), 30)
            assert d.find_element(By.ID, "tool-parse").text.endswith(
                "· 1 of 1 sessions with a failed tool call"
            )
            assert texts(d, "#group-table td.tool-failed") == ["2/3"]
        finally:
            driver.quit()
