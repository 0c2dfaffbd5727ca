"""Dashboard benchmark: page load and live-update latency on a 10,000-session registry
(from an HTTP client and in headless chromium), and the dashboard's CPU while idle and
while sessions move, synthetic and under a real task through the real services.

    python tests/bench/bench_dashboard.py [--sessions 10000] [--rounds 200]
        [--browser-rounds 30] [--update-rounds 30] [--task-sessions 300]
    just bench   # every bench_*.py, this one with its defaults

Starts its own NATS and Valkey, registers the sessions through the registry's own
functions (``create_task``, ``transition``, with their events published as the services
publish them), then the dashboard as ``polar up`` serves it. Then:

- API latency from an HTTP client on the same machine (``--rounds`` GETs a route).
- In Debian's headless chromium (selenium; tests/helpers/browser.py): each page opened
  ``--browser-rounds`` times, from the navigation's start (the browser's Navigation
  Timing) until its data is in the DOM (the app's first render done and the page's own
  elements there, noted by a MutationObserver installed before the page's scripts);
  applying the overview's session filters until the filtered rows are shown; and
  ``--update-rounds`` transitions made through the registry (event on the bus) until
  the open task page, and session page, shows the new state (Date.now() in the page).
- "update" from an HTTP client: a transition until ``/api/live`` says so.
- CPU: the dashboard process's user+system time from /proc over a fixed wall time, idle
  and with synthetic transitions at 50/s.
- With ``--task-sessions`` N (0: skipped): the demo's stack as ``polar up`` starts it
  (scheduler, pool, executor, proxy with the embedded engine, builder, evaluator,
  dashboard), the overview open in chromium; the dashboard's CPU idle for 10 s, then
  while N shell-harness sessions (tasks of 4) each make one chat call with curl through
  the proxy; then the session page and trajectory viewer of one of them, in chromium.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402
import orjson  # noqa: E402

from infra import localservers  # noqa: E402
from schemas import SessionState, TaskRequest  # noqa: E402
from services.common.bus import Bus  # noqa: E402
from services.common.registry import Registry  # noqa: E402
from tests.helpers.procs import ServiceProcess  # noqa: E402

S = SessionState
PER_TASK = 4
READ_TOKEN = "pr_bench-dashboard"  # the bench's own dashboard reads with it
READ = {"authorization": f"Bearer {READ_TOKEN}"}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def register(nats_url: str, redis_url: str, sessions: int) -> dict[str, SessionState]:
    bus = await Bus.open(nats_url, "bench-dashboard")
    reg = Registry.from_url(redis_url, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    rng = random.Random(0)
    ids: dict[str, SessionState] = {}  # session -> the state it was left in
    sem = asyncio.Semaphore(64)

    async def one_task(t: int) -> None:
        async with sem:
            harness = ("shell", "codex", "claude_code")[t % 3]
            task = TaskRequest(
                task_id=f"bench-{t:05d}",
                instruction="x",
                num_samples=PER_TASK,
                agent={"harness": harness, "command": "true"}
                if harness == "shell"
                else {"harness": harness},
            )
            _, created = await reg.create_task(task)
            for s in created:
                ids[s.session_id] = S.REGISTERED
                roll = rng.random()
                if roll < 0.4:
                    continue  # stays REGISTERED
                await reg.transition(s.session_id, S.INITIALIZING, node="node0")
                if roll < 0.7:
                    await reg.transition(s.session_id, S.ERROR, reason=f"boom {t % 7}")
                    ids[s.session_id] = S.ERROR
                else:
                    await reg.transition(s.session_id, S.READY)
                    await reg.transition(s.session_id, S.RUNNING)
                    ids[s.session_id] = S.RUNNING

    await asyncio.gather(*(one_task(t) for t in range(sessions // PER_TASK)))
    await reg.close()
    await bus.close()
    return ids


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def dashboard_pid(root_pid: int) -> list[int]:
    """The server process and its children (granian's worker)."""
    out = [root_pid]
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int(p.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1]) == root_pid:
                    out.append(int(p.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def cpu_over(pids: list[int], seconds: float) -> float:
    a = sum(cpu_seconds(p) for p in pids)
    time.sleep(seconds)
    return (sum(cpu_seconds(p) for p in pids) - a) / seconds


class LiveListener(threading.Thread):
    """Follows /api/live; ``arrived`` maps a version to when it was seen."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.seen = url, []
        self.stop = False

    def run(self) -> None:
        try:
            with httpx.stream("GET", self.url + "/api/live", headers=READ, timeout=None) as r:
                for line in r.iter_lines():
                    if self.stop:
                        return
                    if line.startswith("data:"):
                        self.seen.append(time.monotonic())
        except httpx.HTTPError:
            if not self.stop:  # else: the dashboard stopped at the end of the run
                raise


async def updates(
    url: str, redis_url: str, nats_url: str, ids: list[str], rounds: int
) -> list[float]:
    """ms from a transition (committed, event published) to the next live message."""
    listener = LiveListener(url)
    listener.start()
    await asyncio.sleep(1.5)
    bus = await Bus.open(nats_url, "bench-dashboard-live", declare=False)
    reg = Registry.from_url(redis_url, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    out = []
    registered = ids[:rounds]
    for sid in registered:
        n = len(listener.seen)
        t0 = time.monotonic()
        t = await reg.transition(sid, S.CANCELLED, reason="bench")
        if not t.ok:
            continue
        while len(listener.seen) == n and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.002)
        if len(listener.seen) > n:
            out.append((listener.seen[n] - t0) * 1000)
        await asyncio.sleep(0.6)  # past the push interval, so each change is its own push
    listener.stop = True
    await reg.close()
    await bus.close()
    return out


async def moving(redis_url: str, nats_url: str, ids: list[str], seconds: float, rate: float) -> int:
    bus = await Bus.open(nats_url, "bench-dashboard-load", declare=False)
    reg = Registry.from_url(redis_url, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    n, end = 0, time.monotonic() + seconds
    for sid in ids:
        if time.monotonic() > end:
            break
        if (await reg.transition(sid, S.CANCELLED, reason="load")).ok:
            n += 1
        await asyncio.sleep(1 / rate)
    await reg.close()
    await bus.close()
    return n


# -- in the browser -------------------------------------------------------------------
# Installed before any page script runs (CDP, so the page's CSP does not apply): notes
# performance.now() (ms since the navigation started) when the page has rendered its
# data: the app's first render is done (body[data-rendered]) and every selector named in
# the URL's fragment (#ready=<css>|<css>, which the app ignores) matches.
READY_JS = """
(() => {
  const m = /[#&]ready=([^&]*)/.exec(location.hash);
  const want = m ? decodeURIComponent(m[1]).split("|") : [];
  window.__polarReady = null;
  const obs = new MutationObserver(() => {
    if (window.__polarReady !== null || !document.body || !document.body.dataset.rendered) return;
    if (want.some((css) => !document.querySelector(css))) return;
    window.__polarReady = performance.now();
    obs.disconnect();
  });
  obs.observe(document, { subtree: true, childList: true, attributes: true, characterData: true });
})();
"""

# Applies the overview's session filters and answers (async) the ms from submit until the
# filtered rows are in the DOM (the pager's "a–b of N" changed).
FILTER_JS = """
const [filters, done] = [arguments[0], arguments[arguments.length - 1]];
const form = document.getElementById("filters");
for (const [k, v] of Object.entries(filters)) form.elements[k].value = v;
const before = document.getElementById("sessions-range").textContent;
const t0 = performance.now();
const obs = new MutationObserver(() => {
  const r = document.getElementById("sessions-range");
  if (r && r.textContent !== before) { obs.disconnect(); done(performance.now() - t0); }
});
obs.observe(document.getElementById("main"), { subtree: true, childList: true, characterData: true });
form.requestSubmit();
"""

# Watches one element's text (async script: returns at once): Date.now() when it first
# reads ``want`` goes to window.__polarSeen.
WATCH_JS = """
const [css, want] = arguments;
window.__polarSeen = null;
const obs = new MutationObserver(() => {
  const e = document.querySelector(css);
  if (e && e.textContent.trim() === want) { window.__polarSeen = Date.now(); obs.disconnect(); }
});
obs.observe(document.getElementById("main"), { subtree: true, childList: true, characterData: true });
"""


def open_browser(url: str, read_token: str = READ_TOKEN):
    """A chromium signed in to the dashboard at ``url`` (the link `polar dashboard` prints)."""
    from tests.helpers.browser import minted_sign_in_url, new_browser

    driver = new_browser()
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": READY_JS})
    driver.get(minted_sign_in_url(url, read_token))
    return driver


def load_page(driver, url: str, ready: list[str], timeout: float = 60.0) -> tuple[float, float]:
    """Open ``url`` afresh; (ms until its HTML was received, ms until its data shows),
    both from the start of the navigation, as the browser's clocks say."""
    from urllib.parse import quote

    driver.get("about:blank")  # a full navigation each time, never a same-page one
    driver.get(url + "#ready=" + quote("|".join(ready)))
    end = time.monotonic() + timeout
    while (
        got := driver.execute_script(
            "return [performance.getEntriesByType('navigation')[0].responseEnd, window.__polarReady]"
        )
    )[1] is None:
        if time.monotonic() > end:
            shown = driver.execute_script(
                "return [document.body && document.body.dataset.rendered, location.href,"
                " arguments[0].map((css) => css + ': ' + !!document.querySelector(css)),"
                " document.getElementById('main').textContent.slice(-300)]",
                ready,
            )
            raise TimeoutError(f"{url}: {ready} never rendered; the page: {shown}")
        time.sleep(0.005)
    return got[0], got[1]


def browser_loads(
    driver,
    base: str,
    pages: dict[str, tuple[str, list[str]]],
    rounds: int,
    filters: dict[str, str] | None = None,
) -> dict[str, list[tuple[float, float]]]:
    """Each page ``rounds`` times: name -> [(html ms, rendered ms)]. With ``filters``
    (the overview's session filters), each overview load is followed by applying them."""
    out: dict[str, list[tuple[float, float]]] = {}
    for name, (path, ready) in pages.items():
        for _ in range(rounds):
            out.setdefault(name, []).append(load_page(driver, base + path, ready))
            if filters and path == "/":
                ms = driver.execute_async_script(FILTER_JS, filters)
                out.setdefault("sessions list, filter applied", []).append((0.0, ms))
    return out


def print_loads(loads: dict[str, list[tuple[float, float]]], rounds: int) -> None:
    print(
        f"\n{'in chromium':38} {'HTML p50':>9} {'shown p50':>10} {'shown p99':>10}"
        f"   ms from navigation start ({rounds} loads each)"
    )
    for name, xs in loads.items():
        html, shown = [x[0] for x in xs], [x[1] for x in xs]
        h = f"{pct(html, 50):9.1f}" if any(html) else f"{'–':>9}"
        print(f"{name:38} {h} {pct(shown, 50):10.1f} {pct(shown, 99):10.1f}")


async def move_one(reg: Registry, session_id: str) -> tuple[float, bool]:
    t0 = time.time()
    return t0, (await reg.transition(session_id, S.CANCELLED, reason="bench")).ok


def browser_updates(
    driver,
    base: str,
    redis_url: str,
    nats_url: str,
    targets: list[tuple[str, str, str]],
    quiet: float,
) -> list[float]:
    """For each (page path, css of the element showing the session's state, session): the
    page open and idle, the session cancelled through the registry (its event on the
    bus); ms until the page's DOM shows CANCELLED (Date.now() in the page, same clock)."""
    loop = asyncio.new_event_loop()
    bus = loop.run_until_complete(Bus.open(nats_url, "bench-dashboard-ui", declare=False))
    reg = Registry.from_url(redis_url, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    out = []
    try:
        for path, css, sid in targets:
            load_page(driver, base + path, [css])
            # connected to /api/live (its first message seen) and ``quiet`` s past the
            # page's least time between renders: the next change re-renders at once
            end = time.monotonic() + 10
            while driver.execute_script("return document.body.dataset.liveVersion") is None:
                if time.monotonic() > end:
                    raise TimeoutError(f"{path}: no live message")
                time.sleep(0.01)
            time.sleep(quiet)
            driver.execute_script(WATCH_JS, css, "CANCELLED")
            t0, ok = loop.run_until_complete(move_one(reg, sid))
            if not ok:
                continue
            end = time.monotonic() + 15
            while (seen := driver.execute_script("return window.__polarSeen")) is None:
                if time.monotonic() > end:
                    raise TimeoutError(f"{path}: {sid} never shown CANCELLED")
                time.sleep(0.01)
            out.append(seen - t0 * 1000)
            # the dashboard re-reads a changed session from Redis within refresh_seconds,
            # a second change: let it pass, or the next page's first re-render would be
            # for it, and the measured change would wait out the page's least interval
            time.sleep(1.0)
    finally:
        loop.run_until_complete(reg.close())
        loop.run_until_complete(bus.close())
        loop.close()
    return out


# -- a real task through the real services ------------------------------------------
ONE_CALL = (  # one chat call through the session's proxy route, as any OpenAI client makes
    'curl -sSf -o /dev/null -H "authorization: Bearer $OPENAI_API_KEY" '
    "-H 'content-type: application/json' "
    """-d '{"model":"polar-tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":8}' """
    '"$OPENAI_BASE_URL/chat/completions"'
)
ENDED = ("COMPLETED", "ERROR", "TIMEOUT", "CANCELLED")


async def submit_and_wait(topo, sessions: int, group: int) -> dict[str, int]:
    """``sessions`` one-call sessions as tasks of ``group``, submitted as a client does;
    returns the state counts once every one has ended."""
    from infra import credentials
    from schemas import subjects

    creds = credentials.load(Path(topo.state_dir))
    nats_url = creds.nats_url(topo.nats_url) if creds else topo.nats_url
    redis_url = creds.redis_url(topo.redis_url) if creds else topo.redis_url
    bus = await Bus.open(nats_url, "bench-dashboard-task", declare=False)
    reg = Registry.from_url(redis_url)
    try:
        for t in range(sessions // group):
            task = {
                "task_id": f"real-{t:04d}",
                "instruction": "say hi",
                "num_samples": group,
                "timeout_seconds": 600,
                "runtime": {"backend": "local"},
                "agent": {"harness": "shell", "command": ONE_CALL, "model": "polar-tiny"},
            }
            await bus.js.publish(
                subjects.TASKS_SUBMIT, orjson.dumps(task), headers={"Nats-Msg-Id": task["task_id"]}
            )
        end = time.monotonic() + 1800
        while time.monotonic() < end:
            counts = await reg.state_counts()
            if sum(counts.get(s, 0) for s in ENDED) >= sessions // group * group:
                return counts
            await asyncio.sleep(0.5)
        raise TimeoutError(f"the task did not end: {counts}")
    finally:
        await reg.close()
        await bus.close()


def real_task(sessions: int, group: int, idle_seconds: float, browser_rounds: int) -> None:
    """The demo's stack as ``polar up`` starts it (scheduler, pool, executor, proxy with
    the embedded engine, builder, evaluator, dashboard); the overview open in chromium;
    the dashboard's CPU idle, then while ``sessions`` one-call sessions run."""
    from infra import credentials, devstack
    from infra.topology import parse_topology
    from services.cli.demo import demo_topology

    state_dir = Path(tempfile.mkdtemp(prefix="bench-dash-real-"))
    topo = parse_topology(demo_topology(state_dir, max_run=8), "bench topology")
    state = devstack.up(topo)
    driver = None
    try:
        url = f"http://127.0.0.1:{topo.services['dashboard'].port}"
        root = next(p.pid for p in state.procs if p.name == "dashboard")
        pids = dashboard_pid(root)
        driver = open_browser(url, credentials.load(state_dir).read_token)
        load_page(driver, url + "/", ["#sessions-table"])
        time.sleep(2)
        idle = cpu_over(pids, idle_seconds)
        a, t0 = sum(cpu_seconds(p) for p in pids), time.monotonic()
        counts = asyncio.run(submit_and_wait(topo, sessions, group))
        wall = time.monotonic() - t0
        busy = sum(cpu_seconds(p) for p in pids) - a
        n = sessions // group * group
        assert driver.execute_script("return document.body.dataset.liveVersion") is not None
        print(
            f"\nreal task: {n} one-call sessions (tasks of {group}; shell harness, curl -> proxy"
            f" -> embedded engine; builder, evaluator) in {wall:.1f} s, ended {counts}"
        )
        print(
            f"dashboard CPU with the overview open in chromium: idle {idle * 1000:.1f} ms/s;"
            f" under the task {busy / wall * 1000:.1f} ms/s"
            f" ({busy / n * 1000:.2f} ms per session, {n / wall:.1f} sessions/s)"
        )
        if browser_rounds:
            sid = "real-0000-0000"
            loads = browser_loads(
                driver,
                url,
                {
                    "session page (one call, ended)": (
                        f"/sessions/{sid}",
                        ["#calls-table tr.call"],
                    ),
                    "trajectory viewer": (f"/sessions/{sid}/trajectory", [".trace .tok"]),
                },
                browser_rounds,
            )
            print_loads(loads, browser_rounds)
    finally:
        if driver is not None:
            driver.quit()
        devstack.down(state_dir)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=200, help="GETs per API route")
    ap.add_argument(
        "--browser-rounds", type=int, default=30, help="loads per page in chromium (0: none)"
    )
    ap.add_argument(
        "--update-rounds", type=int, default=30, help="changes watched per page in chromium"
    )
    ap.add_argument(
        "--task-sessions", type=int, default=300, help="sessions of the real task (0: none)"
    )
    args = ap.parse_args()
    browser = args.browser_rounds or args.update_rounds
    root = Path(tempfile.mkdtemp(prefix="bench-dash-"))
    nport, rport = localservers.free_port(), localservers.free_port()
    nats = localservers.start_nats(nport, root / "nats")
    valkey = localservers.start_valkey(rport, root / "valkey")
    nats_url, redis_url = f"nats://127.0.0.1:{nport}", f"redis://127.0.0.1:{rport}/0"
    dash = driver = None
    try:
        t0 = time.monotonic()
        states = asyncio.run(register(nats_url, redis_url, args.sessions))
        ids = list(states)
        print(f"registered {len(ids)} sessions in {time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()
        dash = ServiceProcess(
            "services.dashboard.main:create_app",
            {"nats_url": nats_url, "redis_url": redis_url, "read_token": READ_TOKEN},
            root,
        ).start(timeout=120)
        while httpx.get(dash.url + "/healthz").json()["checks"]["index"]["sessions"] < len(ids):
            time.sleep(0.2)
        print(f"dashboard up with every session indexed in {time.monotonic() - t0:.1f} s")
        pids = dashboard_pid(dash.proc.pid)
        routes = {
            "page shell /": "/",
            "overview (20 tasks)": "/api/overview",
            "sessions, page 1": "/api/sessions",
            "sessions, filtered": "/api/sessions?state=ERROR&reason=boom%203&harness=codex&offset=20",
            "sessions, by reward": "/api/sessions?sort=reward&limit=200",
            "one task": "/api/tasks/bench-00042",
        }
        print(f"\n{'route':28} {'p50 ms':>8} {'p99 ms':>8}   ({args.rounds} GETs each)")
        with httpx.Client(base_url=dash.url, headers=READ, timeout=10) as c:
            for name, path in routes.items():
                ms = []
                for _ in range(args.rounds):
                    t = time.perf_counter()
                    assert c.get(path).status_code == 200
                    ms.append((time.perf_counter() - t) * 1000)
                print(f"{name:28} {pct(ms, 50):8.1f} {pct(ms, 99):8.1f}")
        # sessions a cancel can still move (not ERROR), by task: each is moved once
        live = [sid for sid, st in states.items() if st is not S.ERROR]
        random.Random(1).shuffle(live)
        if browser:
            driver = open_browser(dash.url)
        if args.browser_rounds:
            pages = {  # what must be in the DOM for the page's data to be shown
                "overview": ("/", ["#n-sessions", "#tasks-table tr[data-task]", "#sessions-table"]),
                "task page": ("/tasks/bench-00042", ["#timeline .tl-row", "#sessions-table"]),
                "session page": (f"/sessions/{ids[170]}", ["#verdict", "#calls-table"]),
            }
            filters = {"state": "ERROR", "reason": "boom 3", "harness": "codex"}
            print_loads(
                browser_loads(driver, dash.url, pages, args.browser_rounds, filters),
                args.browser_rounds,
            )
        if args.update_rounds:
            n = args.update_rounds
            task_page = [
                (
                    f"/tasks/{sid.rsplit('-', 1)[0]}",
                    f'#timeline .tl-row[data-session="{sid}"] .state',
                    sid,
                )
                for sid in live[:n]
            ]
            session_page = [(f"/sessions/{sid}", "h1 .state", sid) for sid in live[n : 2 * n]]
            # past each page's least time between renders (app.js LIVE_PAGES: 1 s, 3 s)
            for name, targets, quiet in (
                ("task page", task_page, 1.2),
                ("session page", session_page, 3.2),
            ):
                ms = browser_updates(driver, dash.url, redis_url, nats_url, targets, quiet)
                print(
                    f"update in chromium ({name}): transition -> CANCELLED in the DOM,"
                    f" {len(ms)} changes: p50 {pct(ms, 50):.0f} ms, p99 {pct(ms, 99):.0f} ms"
                )
            live = live[2 * n :]
        if driver is not None:
            driver.quit()
            driver = None
        pushed = asyncio.run(updates(dash.url, redis_url, nats_url, live[:60], 60))
        print(
            f"\nlive update (transition -> /api/live push), {len(pushed)} changes: "
            f"p50 {pct(pushed, 50):.0f} ms, p99 {pct(pushed, 99):.0f} ms"
        )
        idle = cpu_over(pids, 10.0)
        result: dict = {}
        th = threading.Thread(
            target=lambda: result.update(
                n=asyncio.run(moving(redis_url, nats_url, live[60:], 10.0, 50))
            )
        )
        listener = LiveListener(dash.url)
        listener.start()
        th.start()
        busy = cpu_over(pids, 10.0)
        th.join()
        listener.stop = True
        print(
            f"dashboard CPU: idle {idle * 100:.1f}% of a core; with {result.get('n', 0) / 10:.0f} "
            f"transitions/s and one live page open {busy * 100:.1f}%"
        )
    finally:
        if driver is not None:
            driver.quit()
        if dash is not None:
            dash.stop()
        localservers.stop_process(nats.pid)
        localservers.stop_process(valkey.pid)
    if args.task_sessions:
        real_task(args.task_sessions, 4, 10.0, args.browser_rounds)


if __name__ == "__main__":
    main()
