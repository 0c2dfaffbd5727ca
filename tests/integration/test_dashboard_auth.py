"""The dashboard's reads need the stack's read token (issue 17: read-only access kept
separate; issue 19: the dashboard), on a stack `polar up` started, running a real task.

Without a credential, or with a wrong one (a session's own token included), every page
and ``/api`` route is refused (401: JSON for the API, the sign-in page for a page); the
sign-in link `polar dashboard` prints is redeemed once for an HttpOnly, SameSite=Strict
cookie that then reads. And nothing the dashboard serves holds a session's token or a
task's env secret, though the session's harness put both in its output and its prompts.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from infra import credentials
from schemas import subjects as S
from services.common.auth import sign_in_ticket
from services.common.bus import Bus
from services.common.registry import Registry
from services.dashboard.access import Access
from services.dashboard.config import DashboardConfig
from tests.helpers.browser import printed_sign_in_url
from tests.helpers.polar_cli import demo_stack_up

pytestmark = [pytest.mark.timeout(420)]
SECRET = "hunter2-dashboard-plain-value"  # no known key shape: only its place says secret
OTHER_SECRET = "correct-horse-battery-staple-value"

# The harness leaks what it holds every way it can: its token and env values on stdout
# and stderr, and in a prompt (as an agent that ran `env` as a tool would). It prints
# its token reversed too, which no scrubber knows, so the test learns the token.
LEAKY_AGENT = r"""
import json, os, sys, urllib.request
token, base = os.environ["OPENAI_API_KEY"], os.environ["OPENAI_BASE_URL"]
print("TOKREV " + token[::-1])
print("token", token, "base", base, "env", os.environ["DB_PASS"], os.environ["K"])
print("stderr", token, os.environ["DB_PASS"], file=sys.stderr)
dump = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()))
body = {"model": "polar-tiny", "max_tokens": 8, "messages": [
    {"role": "user", "content": "my key is " + token + " and my env: " + dump}]}
req = urllib.request.Request(base.rstrip("/") + "/chat/completions",
    data=json.dumps(body).encode(),
    headers={"content-type": "application/json", "authorization": "Bearer " + token})
urllib.request.urlopen(req, timeout=120).read()
"""


def leaky_task(task_id: str) -> dict:
    return {
        "task_id": task_id,
        "instruction": "leak what you hold",
        "num_samples": 1,
        "timeout_seconds": 300,
        "runtime": {
            "backend": "local",
            "env": {"DB_PASS": SECRET},
            "prepare": [{"action": "upload_file", "content": LEAKY_AGENT, "dest": "agent.py"}],
        },
        "agent": {
            "harness": "shell",
            "command": f"{sys.executable} agent.py",
            "model": "polar-tiny",
            "env": {"K": OTHER_SECRET},
        },
        "builder": {"name": "prefix_merging"},
        # its test command prints the env secret and no test results: the evaluator's
        # error reason quotes that output (redacted by shape only: this value has none)
        "evaluator": {
            "name": "test_on_output",
            "config": {
                "test_command": f"{sys.executable} -c \"import os; print(os.environ['DB_PASS'])\""
            },
        },
    }


@pytest.fixture(scope="module")
def stack():
    """The demo's stack, started by `polar up` (which prints the dashboard's sign-in link)."""
    with demo_stack_up("polar-dash-auth-") as (topo, topology, up):
        link = re.search(r"the dashboard: (http://\S+/\?token=\S+)", up.stdout)
        assert link, up.stdout
        url = f"http://127.0.0.1:{topo.services['dashboard'].port}"
        yield topo, topology, url, link[1]


def creds_of(topo) -> credentials.Credentials:
    creds = credentials.load(Path(topo.state_dir))
    assert creds is not None
    return creds


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


API = (
    "/api/overview",
    "/api/sessions",
    "/api/tasks/dash-leak",
    "/api/sessions/dash-leak-0000",
    "/api/sessions/dash-leak-0000/trajectory",
    "/api/training",
    "/api/topology",
    "/api/live",
)
PAGES = ("/", "/tasks/dash-leak", "/sessions/dash-leak-0000", "/training", "/topology")


def test_no_credential_or_a_wrong_one_is_refused(stack):
    topo, _, url, _ = stack
    creds = creds_of(topo)
    session_token = "ps_" + "A" * 43  # a harness's own kind of token
    for headers in ({}, bearer("wrong"), bearer(session_token), bearer(creds.read_token + "x")):
        for path in API:
            r = httpx.get(url + path, headers=headers, timeout=10)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.headers["content-type"].startswith("application/json")
            assert r.json()["detail"], path
            assert r.headers["www-authenticate"] == "Bearer"
        for path in PAGES:
            r = httpx.get(url + path, headers=headers, timeout=10)
            assert r.status_code == 401 and 'data-page="signin"' in r.text, path
    # an unknown id says nothing either: refused before it is looked up
    assert httpx.get(url + "/sessions/no-such").status_code == 401
    # a cookie that is not a signed-in one
    port = topo.services["dashboard"].port
    r = httpx.get(url + "/api/sessions", cookies={f"polar_dashboard_{port}": "1.forged"})
    assert r.status_code == 401 and "expired" in r.json()["detail"]
    # open: what every service serves, and the files the sign-in page needs
    for path in ("/healthz", "/metrics", "/static/app.js", "/static/style.css"):
        assert httpx.get(url + path).status_code == 200, path


def test_the_printed_link_signs_a_browser_in_once(stack):
    topo, topology, url, link = stack  # the link `polar up` printed
    creds = creds_of(topo)
    assert link.startswith(url + "/?token=")
    assert creds.read_token not in link and creds.admin_token not in link
    with httpx.Client(timeout=10) as browser:
        r = browser.get(link)
        assert r.status_code == 303 and r.headers["location"] == "/"  # the ticket dropped
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert creds.read_token not in cookie
        assert browser.get(url + "/").status_code == 200
        for path in ("/api/overview", "/api/sessions", "/api/training", "/api/topology"):
            assert browser.get(url + path).status_code == 200, path
        with browser.stream("GET", url + "/api/live") as live:  # the event stream too
            assert live.status_code == 200
            assert next(live.iter_lines()).startswith("event: change")
        # signed in is not admin: a cancel still needs the admin token
        r = browser.post(url + "/api/tasks/dash-leak/cancel")
        assert r.status_code == 401 and "admin token" in r.json()["detail"]
        r = browser.post(url + "/api/tasks/dash-leak/cancel", headers=bearer(creds.read_token))
        assert r.status_code == 401
    with httpx.Client(timeout=10) as other:  # the same link again: used up
        r = other.get(link)
        assert r.status_code == 401 and "used already" in r.text
        assert other.get(url + "/api/sessions").status_code == 401
    # a deep link keeps its page and its other parameters
    deep = printed_sign_in_url(topology).replace(
        "/?token=", "/sessions/x/trajectory?view=per_request&token="
    )
    r = httpx.get(deep)
    assert (
        r.status_code == 303 and r.headers["location"] == "/sessions/x/trajectory?view=per_request"
    )
    # the read and the admin token work as bearer tokens
    for token in (creds.read_token, creds.admin_token):
        assert httpx.get(url + "/api/sessions", headers=bearer(token)).status_code == 200


async def publish(topo, task: dict) -> None:
    bus = await Bus.open(creds_of(topo).nats_url(topo.nats_url), "dash-auth", declare=False)
    try:
        await bus.js.publish(S.TASKS_SUBMIT, orjson.dumps(task))
    finally:
        await bus.close()


async def until_ended(topo, session_id: str) -> None:
    reg = Registry.from_url(creds_of(topo).redis_url(topo.redis_url))
    try:
        for _ in range(600):
            s = await reg.get_session(session_id)
            if s is not None and s.state.value in ("COMPLETED", "ERROR", "TIMEOUT"):
                return
            await asyncio.sleep(0.5)
        raise AssertionError(f"{session_id} never ended")
    finally:
        await reg.close()


def test_nothing_served_holds_a_session_token_or_an_env_secret(stack):
    topo, _, url, _ = stack
    creds = creds_of(topo)
    asyncio.run(publish(topo, leaky_task("dash-leak")))
    asyncio.run(until_ended(topo, "dash-leak-0000"))
    read = bearer(creds.read_token)

    def get(path: str) -> bytes:
        r = httpx.get(url + path, headers=read, timeout=30)
        assert r.status_code == 200, (path, r.text)
        return r.content

    # its page once it shows the harness's stdout (artifacts come with the finish event)
    session = {}
    for _ in range(60):
        session = orjson.loads(get("/api/sessions/dash-leak-0000"))
        if session.get("settled"):
            break
        asyncio.run(asyncio.sleep(0.5))
    stdout = session["artifacts"]["stdout_tail"]["text"]
    token = next(ln for ln in stdout.splitlines() if ln.startswith("TOKREV "))[7:][::-1]
    assert re.fullmatch(r"ps_[A-Za-z0-9_-]{43}", token), token
    assert session["calls"], "the harness's model call is on its page"

    served = {
        path: get(path)
        for path in (
            "/api/overview",
            "/api/sessions",
            "/api/sessions?task=dash-leak",
            "/api/tasks/dash-leak",
            "/api/sessions/dash-leak-0000",
            "/api/sessions/dash-leak-0000/trajectory?view=stored",
            "/api/sessions/dash-leak-0000/trajectory?view=per_request",
            "/api/sessions/dash-leak-0000/trajectory?view=prefix_merging",
            "/api/topology",
            "/api/training",
            "/",
            "/tasks/dash-leak",
            "/sessions/dash-leak-0000",
            "/sessions/dash-leak-0000/trajectory",
        )
    }
    with httpx.stream("GET", url + "/api/live", headers=read, timeout=10) as live:
        lines = live.iter_lines()
        served["/api/live"] = (next(lines) + next(lines)).encode()  # event: and data:
    secrets = {
        "the session's token": token,
        "the token without ps_": token.removeprefix("ps_"),
        "runtime env": SECRET,
        "agent env": OTHER_SECRET,
        "the read token": creds.read_token,
        "the admin token": creds.admin_token,
        "the Redis password": creds.redis_password,
        **{f"NATS password of {u}": p for u, p in creds.nats_passwords.items()},
    }
    leaks = [
        f"{what} in {path}"
        for path, body in served.items()
        for what, value in secrets.items()
        if value and value.encode() in body
    ]
    assert not leaks, leaks
    # what was scrubbed is still visibly there, as a placeholder: the output (scrubbed by
    # the executor), the harness's request and the decoded prompt (by the dashboard)
    assert "[redacted]" in stdout
    assert "[redacted]" in session["session"]["eval_reason"]  # the evaluator quoted it
    assert "my key is ps_[redacted]" in session["calls"][0]["request"]["text"]
    assert b"DB_PASS=[redacted]" in served["/api/sessions/dash-leak-0000/trajectory?view=stored"]


async def test_a_link_used_once_is_refused_by_a_restarted_or_other_dashboard(redis_url):
    """Its use is recorded in the registry until the link expires, not in the dashboard's
    memory: a dashboard started afterwards (a restart, a replica) refuses it too."""
    reg = Registry.from_url(redis_url)
    try:
        cfg = DashboardConfig(port=8161, read_token="pr_restart")
        now = time.time()
        link = sign_in_ticket("pr_restart", "dashboard", now=now, ttl=30)
        first, later = Access(cfg), Access(cfg)  # two processes' worth of state
        cookie, why = await first.sign_in(link, reg.use_ticket, now=now)
        assert why is None and cookie
        cookie, why = await later.sign_in(link, reg.use_ticket, now=now + 1)
        assert cookie is None and "used already" in why
        nonce = link.split(".")[1]
        ttl = await reg.redis.ttl(S.key_ticket("dashboard", nonce))
        assert 0 < ttl <= 30  # kept until the link expires, then gone
        # another link still works
        other = sign_in_ticket("pr_restart", "dashboard", now=now)
        assert (await later.sign_in(other, reg.use_ticket, now=now))[1] is None
    finally:
        await reg.close()
