"""``kill -9`` of every service, of the proxy, the model, nats-server and Valkey, mid-run
(issue 17's fault table, rerun in CI: `just test` runs it).

One stack of real processes on servers of its own (free ports, its own directories, so
it may kill them): scheduler, runtime pool, executor, builder, evaluator, the proxy and
the embedded engine (the tiny model). The servers run as ``polar up`` runs them:
nats-server with a user per service (``infra/credentials.py``; each service signs in as
its own), Valkey with a password and the dev stack's durability (``appendfsync
everysec``, ``localservers.start_valkey``). Tasks are submitted on the bus; each session
prepares (a short exec step) and runs a multi-call agent (``agent.py``: 3 chat calls
through its proxy route, each retried while the stack is faulty, as CLIs retry). Every
fault is injected ``ROUNDS`` (3) times, each time while a fresh task of its own is in the
stage that fault hurts most; the killed process is started again at once, except
Valkey, which stays down ``VALKEY_OUTAGE_S`` (an outage, as in the issue) and comes back
on its same directory.

Then: every session final within ``BOUND_S`` of the last fault, exactly one trajectory
per session in ``polar.trajectories.<task>`` (0 lost, 0 duplicated), every task's group
whole, every COMPLETED session's trajectory holding all ``CALLS`` of its model calls,
and no session ended ERROR (the harness never fails on its own here, so an ERROR would
be a fault of the system that was not retried away). The table is printed in the terminal summary (`just test` passes no ``-s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import redis.asyncio as aioredis

from schemas import TERMINAL_STATES, SessionState
from schemas import subjects as S
from services.common.bus import Bus
from tests.chaos.stack import (
    CALLS,
    INFRA_RETRIES,
    SESSIONS,
    TARGETS,
    VALKEY_OUTAGE_S,
    Stack,
    delivered,
    publish,
    states,
    task,
    wait_for_state,
)

pytestmark = pytest.mark.asyncio
ST = SessionState
# every fault three times in `just test` (the "each fault 3 times");
# POLAR_CHAOS_ROUNDS=1 for a quick look
ROUNDS = int(os.environ.get("POLAR_CHAOS_ROUNDS", "3"))
# Every session final within this of the last fault (its process restarted). Sessions
# submitted early live through every later round's faults (retried each time a holder
# dies), so from submission their time is the whole run's; once the faults stop, what
# is left settles within seconds.
BOUND_S = 60.0
# How long a killed process stays down before it is started again (the 5 s /
# 30 s / 120 s matrix: `POLAR_CHAOS_DOWN_S=30 just test-chaos`); unset: services, the
# model and nats-server at once, Valkey after VALKEY_OUTAGE_S.
DOWN_S = float(os.environ["POLAR_CHAOS_DOWN_S"]) if os.environ.get("POLAR_CHAOS_DOWN_S") else None
# the agent retries each call longer than anything stays down
RETRY_CALLS_S = max(90.0, (DOWN_S or 0.0) + 60.0)
assert 2 * ROUNDS <= INFRA_RETRIES, "more rounds than a task's infra_retries can absorb"
# (fault, the session state a kill should catch the fault's own task in). A round
# injects every fault at once, each when its own task reaches its stage.
FAULTS = [
    ("scheduler", None),  # killed as its task is submitted
    ("pool", ST.INITIALIZING),
    ("executor", ST.RUNNING),
    ("builder", ST.POSTRUN),
    ("evaluator", ST.EVALUATING),
    ("proxy", ST.RUNNING),  # the agent's calls in flight
    ("model", ST.RUNNING),
    ("nats-server", ST.READY),
    ("valkey", ST.RUNNING),
]
if os.environ.get("CHAOS_FAULTS"):  # a subset, to look at one fault: CHAOS_FAULTS=pool,valkey
    FAULTS = [f for f in FAULTS if f[0] in os.environ["CHAOS_FAULTS"].split(",")]


@dataclass
class Row:
    fault: str
    kills: int = 0
    caught: Counter = field(default_factory=Counter)  # the task's states at each kill
    tasks: list[str] = field(default_factory=list)


async def inject(stack: Stack, bus: Bus, redis, row: Row, stage: ST | None, r: int) -> None:
    fault = row.fault
    task_id = f"chaos-{fault.replace('-', '')}-{r}"
    row.tasks.append(task_id)
    stack.submitted[task_id] = time.monotonic()
    if fault == "scheduler":  # dies with the submission in its queue
        stack.procs["scheduler"].kill()
        await publish(bus, task_id, task(task_id, RETRY_CALLS_S))
        row.caught["submitted"] += 1
        await asyncio.sleep(DOWN_S or 0.0)
        await asyncio.to_thread(stack.start, "scheduler", 8 + 2 * int(DOWN_S or 0))
    else:
        await publish(bus, task_id, task(task_id, RETRY_CALLS_S))
        row.caught[await wait_for_state(redis, task_id, stage)] += 1
        await stack.kill_and_restart(fault, DOWN_S)
    row.kills += 1


@pytest.mark.timeout(120 + (90 + 2 * (DOWN_S or 0.0)) * ROUNDS)  # a round: ~50 s + down
async def test_kill_9_every_service_and_server_mid_run(tmp_path, chaos_report):
    if shutil.which("sh") is None:
        pytest.skip("needs a POSIX shell for the harness")
    stack = Stack(tmp_path)
    stack.start_servers()
    redis = aioredis.from_url(stack.client_redis_url, socket_timeout=2)
    bus = None
    rows = [Row(f) for f, _ in FAULTS]
    t0 = time.monotonic()
    try:
        for name in ("proxy", *(t for t in TARGETS if t != "proxy")):  # nodes need its URL
            await asyncio.to_thread(stack.start, name)
        bus = await Bus.open(stack.client_nats_url, "chaos-test")
        started = time.monotonic() - t0
        for r in range(ROUNDS):  # each round: every fault once, each on a task of its own
            await asyncio.gather(*(inject(stack, bus, redis, row, stage, r)
                                   for row, (_, stage) in zip(rows, FAULTS, strict=True)))  # fmt: skip
            print(f"round {r}: done at {time.monotonic() - t0:.1f}s", flush=True)
        faults_done = time.monotonic()

        # every session final, within the bound of its task's submission
        final = {s.value for s in TERMINAL_STATES}
        final_at: dict[str, float] = {}  # seconds from its submission
        settled: dict[str, float] = {}  # seconds after the last fault
        pending = {t for row in rows for t in row.tasks}
        deadline = faults_done + BOUND_S + 1
        while pending and time.monotonic() < deadline:
            for task_id in list(pending):
                with contextlib.suppress(Exception):
                    now = await states(redis, task_id)
                    if len(now) == SESSIONS and set(now) <= final:
                        final_at[task_id] = time.monotonic() - stack.submitted[task_id]
                        settled[task_id] = max(0.0, time.monotonic() - faults_done)
                        pending.discard(task_id)
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # a duplicate would have been published by now
        got, calls = await delivered(bus)
        ended = {}  # session id -> final state, for the ERROR count
        for row in rows:
            for t in row.tasks:
                for i in range(SESSIONS):
                    sid = f"{t}-{i:04d}"
                    ended[sid] = (await redis.hget(S.key_session(sid), "state") or b"?").decode()
        table = []
        for row in rows:
            sids = [f"{t}-{i:04d}" for t in row.tasks for i in range(SESSIONS)]
            lost = sum(1 for s in sids if got[s] == 0)
            dup = sum(got[s] - 1 for s in sids if got[s] > 1)
            stuck = sum(1 for t in row.tasks if settled.get(t, BOUND_S + 1) > BOUND_S)
            errors = sum(1 for s in sids if ended[s] == ST.ERROR.value)
            # a COMPLETED session's agent had all its calls answered, each captured
            # before its answer was sent: fewer in its trajectory is a lost call
            short = sum(1 for s in sids if ended[s] == "COMPLETED" and calls[s] < CALLS)
            groups = sum(
                1 for t in row.tasks if all(got[f"{t}-{i:04d}"] == 1 for i in range(SESSIONS))
            )
            after = max((settled[t] for t in row.tasks if t in settled), default=float("nan"))
            ncalls = sum(calls[s] for s in sids)
            table.append((row, len(sids), lost, dup, stuck, errors, groups, ncalls, short, after))
        downs = (
            f"every process down {DOWN_S:.0f}s per kill"
            if DOWN_S is not None
            else f"Valkey down {VALKEY_OUTAGE_S:.0f}s per kill, the rest restarted at once"
        )
        lines = [
            f"chaos: {len(rows)} faults x {ROUNDS} kills, {SESSIONS} sessions per task, "
            f"{CALLS} model calls per session, {downs}; "
            f"stack up in {started:.1f}s, faults done at {faults_done - t0:.1f}s, "
            f"all final at {time.monotonic() - t0:.1f}s (bound: {BOUND_S:.0f}s after the last fault)",
            f"{'fault':<12}{'kills':>6}{'sessions':>9}{'lost':>6}{'dup':>5}{'stuck':>7}{'ERROR':>7}"
            f"{'groups':>8}{'calls':>7}{'short':>7}{'final after faults s':>22}  caught in",
        ]
        for row, n, lost, dup, stuck, errors, groups, ncalls, short, after in table:
            caught = ", ".join(f"{k} x{v}" for k, v in sorted(row.caught.items()))
            lines.append(
                f"{row.fault:<12}{row.kills:>6}{n:>9}{lost:>6}{dup:>5}{stuck:>7}{errors:>7}"
                f"{groups:>5}/{len(row.tasks)}{ncalls:>7}{short:>7}{after:>22.1f}  {caught}"
            )
        for row in rows:  # what a stuck or undelivered session looks like, for the log
            for t in row.tasks:
                for i in range(SESSIONS):
                    sid = f"{t}-{i:04d}"
                    if got[sid] != 1 or t not in final_at or ended[sid] == ST.ERROR.value:
                        h = await redis.hgetall(S.key_session(sid))
                        keep = ("state", "attempt", "outcome", "reason", "eval_status")
                        lines.append(f"  {sid}: {got[sid]} delivered, " + ", ".join(
                            f"{k}={h.get(k.encode(), b'').decode()[:160]}" for k in keep))  # fmt: skip
        lines.append(f"chaos module: {time.monotonic() - t0:.1f}s")
        chaos_report.extend(lines)
        print("\n".join(lines))
        for row, _, lost, dup, stuck, _, groups, _, short, _ in table:
            assert (lost, dup, stuck, groups, short) == (0, 0, 0, len(row.tasks), 0), row.fault
        reasons = {}
        for sid, state in ended.items():
            if state == ST.ERROR.value:
                raw = await redis.hget(S.key_session(sid), "reason")
                reasons[sid] = (raw or b"").decode()
        assert not reasons, f"sessions ended ERROR: {reasons}"
    finally:
        if bus is not None:
            with contextlib.suppress(Exception):
                await bus.close()
        with contextlib.suppress(Exception):
            await redis.aclose()
        stack.stop()
