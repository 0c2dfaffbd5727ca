"""NATS away for a long while mid-run (issue 33: 30 s left 2 sessions of 40 REGISTERED
with no INIT work until their deadline): nothing stuck, lost or duplicated after it.

One stack of real processes (``tests/chaos/stack.py``). Per outage: tasks are submitted
on the bus and caught in every stage (waiting, INIT, READY, running, being built),
nats-server is killed and kept down ``OUTAGE`` seconds, a task is submitted over the
scheduler's HTTP API meanwhile (accepted: it is registered, and its INIT work waits in
the outbox), then nats-server comes back on its same port and store. Every session must
end within ``BOUND_S`` of the outage's end, with exactly one trajectory, none ERROR
(every fault here is the system's and retried away), and the outbox empty.

A poison plugin rides along: one task's evaluator ends the evaluator's process each time
it runs. The evaluator runs under a supervisor (restarted when its process ends, as
systemd or Kubernetes would), and the quarantine stops the poison after 4 deaths: its
sessions end with the reason while the rest is served.

`just test` runs a 30 s outage; `POLAR_CHAOS_NATS_OUTAGES=30,120 just test-chaos` both.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import httpx
import pytest
import redis.asyncio as aioredis

from schemas import TERMINAL_STATES, SessionState
from schemas import subjects as S
from services.common.bus import Bus
from tests.chaos.stack import SESSIONS, TARGETS, Stack, delivered, publish, states, task

pytestmark = pytest.mark.asyncio
ST = SessionState
OUTAGES = [float(s) for s in os.environ.get("POLAR_CHAOS_NATS_OUTAGES", "30").split(",")]
# every session final within this of NATS's return: a bound for a hang (the loop ends as
# soon as all are final; 26.7 s was the slowest seen), not a margin on a loaded machine
BOUND_S = 300.0
TASKS_BEFORE = 3  # on the bus, caught mid-run by the outage
POISON = "tests.helpers.killer_plugins:ExitsProcess"  # an evaluator that ends its process


async def outage(stack: Stack, bus: Bus, redis, seconds: float, n: int, report: list) -> list[str]:
    retry_s = seconds + 60.0
    ids = [f"outage{n}-bus{i}" for i in range(TASKS_BEFORE)]
    poison = f"outage{n}-poison"
    await publish(bus, poison, task(poison, retry_s, evaluator={"name": POISON}))
    for task_id in ids:
        await publish(bus, task_id, task(task_id, retry_s))
        await asyncio.sleep(0.7)  # spread over the stages: the last one just submitted
    seen = sorted({s for t in ids for s in await states(redis, t)} or {"unregistered"})
    stack.nats.kill()
    stack.nats.wait(10)
    started = time.monotonic()
    # submitted while the bus is away: the scheduler registers it and keeps its work
    http_id = f"outage{n}-http"
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(
            stack.procs["scheduler"].url + "/tasks",
            content=task(http_id, retry_s),
            headers={"authorization": f"Bearer {stack.creds.admin_token}"},
        )
    assert r.status_code == 201, r.text
    await asyncio.sleep(max(0.0, seconds - (time.monotonic() - started)))
    await asyncio.to_thread(stack._start_nats)
    back = time.monotonic()
    ids += [http_id, poison]
    final = {s.value for s in TERMINAL_STATES}
    pending, settled = set(ids), {}
    while pending and time.monotonic() < back + BOUND_S:
        for task_id in list(pending):
            with contextlib.suppress(Exception):
                now = await states(redis, task_id)
                if len(now) == SESSIONS and set(now) <= final:
                    settled[task_id] = time.monotonic() - back
                    pending.discard(task_id)
        await asyncio.sleep(0.5)
    report.append((seconds, seen, ids, settled, pending))
    return ids


@pytest.mark.timeout(180 + sum(OUTAGES) * 2 + BOUND_S)
async def test_nats_outages_mid_run_leave_nothing_stuck(tmp_path, chaos_report):
    stack = Stack(tmp_path)
    stack.start_servers()
    redis = aioredis.from_url(stack.client_redis_url, socket_timeout=2)
    bus = supervisor = None
    report: list = []
    try:
        for name in ("proxy", *(t for t in TARGETS if t != "proxy")):
            await asyncio.to_thread(stack.start, name)
        bus = await Bus.open(stack.client_nats_url, "outage-test")
        restarts: list[float] = []
        supervisor = asyncio.create_task(stack.supervise("evaluator", restarts))
        for n, seconds in enumerate(OUTAGES):
            await outage(stack, bus, redis, seconds, n, report)
        await asyncio.sleep(1.0)  # a duplicate would have been published by now
        got, _ = await delivered(bus)
        lines = ["NATS outages: outage s, caught in, sessions, final, lost, dup, ERROR, stuck,"
                 " final after its end s"]  # fmt: skip
        failures = []
        for seconds, seen, ids, settled, pending in report:
            sids = [f"{t}-{i:04d}" for t in ids for i in range(SESSIONS)]
            ended = {
                s: (await redis.hget(S.key_session(s), "state") or b"?").decode() for s in sids
            }
            lost = sum(1 for s in sids if got[s] == 0)
            dup = sum(got[s] - 1 for s in sids if got[s] > 1)
            errors = {s: (await redis.hget(S.key_session(s), "reason") or b"").decode()
                      for s in sids if ended[s] == ST.ERROR.value}  # fmt: skip
            stuck = len(pending) * SESSIONS
            final = sum(1 for s in sids if ended[s] in {x.value for x in TERMINAL_STATES})
            worst = max(settled.values(), default=float("nan"))
            lines.append(
                f"  {seconds:>5.0f}  {'/'.join(seen):<40} {len(sids):>3} {final:>3} {lost:>3} "
                f"{dup:>3} {len(errors):>3} {stuck:>3} {worst:>6.1f}"
            )
            if lost or dup or errors or stuck:
                failures.append((seconds, lost, dup, errors, sorted(pending)))
        # what the outbox kept during the outage is relayed once due (its grace after)
        for _ in range(120):
            if not await redis.zcard(S.KEY_OUTBOX_DUE):
                break
            await asyncio.sleep(0.5)
        lines.append(f"outbox left: {await redis.zcard(S.KEY_OUTBOX_DUE)}")
        supervisor.cancel()
        for n in range(len(OUTAGES)):  # the poison's sessions ended, quarantined
            for i in range(SESSIONS):
                row = await redis.hgetall(S.key_session(f"outage{n}-poison-{i:04d}"))
                why = row.get(b"eval_reason", b"").decode()
                lines.append(f"poison session {n}/{i}: {why[:100]}")
                if not why.startswith("quarantined: the evaluator's process died"):
                    print(row, stack.log_tail("evaluator", 80), sep="\n")
                    raise AssertionError(f"poison session {n}/{i} not quarantined: {row}")
        lines.append(f"the evaluator restarted {len(restarts)} times by its supervisor")
        chaos_report.extend(lines)
        print("\n".join(lines))
        assert not failures, failures
        assert await redis.zcard(S.KEY_OUTBOX_DUE) == 0
    finally:
        if supervisor is not None:
            supervisor.cancel()
        if bus is not None:
            with contextlib.suppress(Exception):
                await bus.close()
        with contextlib.suppress(Exception):
            await redis.aclose()
        stack.stop()
