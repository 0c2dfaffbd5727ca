"""Dashboard benchmark: page load and live-update latency on a 10,000-session registry,
and the dashboard's CPU while idle and while sessions move.

    python tests/bench/bench_dashboard.py [--sessions 10000] [--rounds 200]

Starts its own NATS and Valkey, registers the sessions through the registry's own
functions (``create_task``, ``transition``, with their events published as the services
publish them), then the dashboard as ``polar up`` serves it. Latency is measured from
an HTTP client on the same machine; "update" is a transition made in Redis (event on
the bus) until the browser's event stream (``/api/live``) says so. CPU is the
dashboard process's user+system time from /proc over a fixed wall time.
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

from infra import localservers  # noqa: E402
from schemas import SessionState, TaskRequest  # noqa: E402
from services.common.bus import Bus  # noqa: E402
from services.common.registry import Registry  # noqa: E402
from tests.helpers.procs import ServiceProcess  # noqa: E402

S = SessionState
PER_TASK = 4


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def register(nats_url: str, redis_url: str, sessions: int) -> list[str]:
    bus = await Bus.open(nats_url, "bench-dashboard")
    reg = Registry.from_url(redis_url, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    rng = random.Random(0)
    ids: list[str] = []
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
                ids.append(s.session_id)
                roll = rng.random()
                if roll < 0.4:
                    continue  # stays REGISTERED
                await reg.transition(s.session_id, S.INITIALIZING, node="node0")
                if roll < 0.7:
                    await reg.transition(s.session_id, S.ERROR, reason=f"boom {t % 7}")
                else:
                    await reg.transition(s.session_id, S.READY)
                    await reg.transition(s.session_id, S.RUNNING)

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
        with httpx.stream("GET", self.url + "/api/live", timeout=None) as r:
            for line in r.iter_lines():
                if self.stop:
                    return
                if line.startswith("data:"):
                    self.seen.append(time.monotonic())


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-dash-"))
    nport, rport = localservers.free_port(), localservers.free_port()
    nats = localservers.start_nats(nport, root / "nats")
    valkey = localservers.start_valkey(rport, root / "valkey")
    nats_url, redis_url = f"nats://127.0.0.1:{nport}", f"redis://127.0.0.1:{rport}/0"
    dash = None
    try:
        t0 = time.monotonic()
        ids = asyncio.run(register(nats_url, redis_url, args.sessions))
        print(f"registered {len(ids)} sessions in {time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()
        dash = ServiceProcess(
            "services.dashboard.main:create_app",
            {"nats_url": nats_url, "redis_url": redis_url},
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
        with httpx.Client(base_url=dash.url, timeout=10) as c:
            for name, path in routes.items():
                ms = []
                for _ in range(args.rounds):
                    t = time.perf_counter()
                    assert c.get(path).status_code == 200
                    ms.append((time.perf_counter() - t) * 1000)
                print(f"{name:28} {pct(ms, 50):8.1f} {pct(ms, 99):8.1f}")
        registered = list(ids)  # CANCELLED is allowed from any live state
        random.Random(1).shuffle(registered)
        live = asyncio.run(updates(dash.url, redis_url, nats_url, registered[:60], 60))
        print(
            f"\nlive update (transition -> /api/live push), {len(live)} changes: "
            f"p50 {pct(live, 50):.0f} ms, p99 {pct(live, 99):.0f} ms"
        )
        idle = cpu_over(pids, 10.0)
        result: dict = {}
        th = threading.Thread(
            target=lambda: result.update(
                n=asyncio.run(moving(redis_url, nats_url, registered[60:], 10.0, 50))
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
        if dash is not None:
            dash.stop()
        localservers.stop_process(nats.pid)
        localservers.stop_process(valkey.pid)


if __name__ == "__main__":
    main()
