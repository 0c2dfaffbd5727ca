"""What the dashboard's banner says is the stack's state, held while it lasts and pushed
when it changes (issue 19: NATS or Redis down is a banner, not a crash).

A missing session-events stream is said until the dashboard follows the stream, not only
between two stack polls (each poll used to clear it, so the banner flickered with the
poll); and the live stream sends a change as soon as the problems change, not at its
15-second heartbeat. Real NATS, Valkey and a served dashboard; no browser.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest

from infra import localservers
from services.dashboard.config import DashboardConfig
from services.dashboard.reader import StackReader
from tests.helpers.stack import declare_streams, lone_dashboard

pytestmark = [pytest.mark.timeout(180)]
NO_STREAM = "no session events stream yet"


async def samples(reader: StackReader, seconds: float) -> list[list[str]]:
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        out.append(reader.problems())
        await asyncio.sleep(0.05)
    return out


async def until(check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)
    return got


async def test_a_missing_events_stream_stays_in_the_problems_until_followed(fresh_servers):
    nats_url, redis_url = fresh_servers
    cfg = DashboardConfig(
        nats_url=nats_url, redis_url=redis_url, refresh_seconds=0.1, stack_poll_seconds=0.1
    )
    reader = StackReader(cfg)
    await reader.start()
    try:
        await until(lambda: reader.bus is not None and reader.events_error)
        await until(lambda: reader.nats_error is None and reader.redis_error is None)
        # polls (every 0.1 s) succeed all the while: the stream's absence is not cleared by them
        seen = await samples(reader, 2.0)
        assert len(seen) > 20
        assert all(len(p) == 1 and NO_STREAM in p[0] for p in seen), seen
        await asyncio.to_thread(declare_streams, nats_url)
        await until(lambda: reader.problems() == [])
        assert all(p == [] for p in await samples(reader, 1.0))
    finally:
        await reader.stop()


def change_events(lines, timeout: float):
    """The ``change`` events' data read from an SSE line iterator within ``timeout``."""
    deadline = time.monotonic() + timeout
    for line in lines:
        if line.startswith("data:"):
            yield orjson.loads(line[5:])
        if time.monotonic() > deadline:
            return


def test_the_live_stream_sends_a_change_of_problems_at_once(tmp_path):
    with lone_dashboard(tmp_path, "pr_problems-test", streams=False) as lone:
        read = {"authorization": f"Bearer {lone.config['read_token']}"}
        url = lone.dash.url + "/api/live"
        with httpx.stream("GET", url, headers=read, timeout=30) as live:
            events = change_events(live.iter_lines(), 60)
            first = next(e for e in events if any(NO_STREAM in p for p in e["problems"]))
            started = time.monotonic()
            declare_streams(lone.config["nats_url"])
            cleared = next(e for e in events if e["problems"] == [])
            # well inside the 15 s heartbeat: the change itself was sent
            assert time.monotonic() - started < 8, (first, cleared)
            started = time.monotonic()
            localservers.stop_process(lone.valkey.pid)
            down = next(e for e in events if e["problems"])
            assert time.monotonic() - started < 8
            assert any("cannot reach Redis" in p for p in down["problems"]), down
            assert cleared["version"] == down["version"]  # no session changed: only problems


async def test_a_restarted_dashboard_reads_a_runs_artifacts_back(fresh_servers):
    """Artifacts came only with the SessionFinished on its way to the builder: a
    dashboard started later had none (issue 38.12). The builder's stored copy is read."""
    from schemas import Artifacts, encode
    from schemas import subjects as S
    from services.common.bus import Bus

    nats_url, redis_url = fresh_servers
    await asyncio.to_thread(declare_streams, nats_url)
    bus = await Bus.open(nats_url, "artifacts-writer", declare=False)
    art = Artifacts(exit_code=3, stderr_tail="sh: 1: ./agent.sh: not found\n")
    await (await bus.blobs()).put(S.artifacts_object("old-task-0000", 1), encode(art))
    await bus.close()
    reader = StackReader(DashboardConfig(nats_url=nats_url, redis_url=redis_url))
    await reader.start()
    try:
        await until(lambda: reader.bus is not None)
        assert await reader.run_artifacts("old-task-0000", 1) == art
        assert await reader.run_artifacts("never-ran-0000", 0) is None
    finally:
        await reader.stop()
