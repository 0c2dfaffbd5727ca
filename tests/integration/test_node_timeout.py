"""Agent timeout through pool + executor: the harness's whole process tree is killed
(background, double-forked, setsid'd and TERM-ignoring children included), the session
ends TIMEOUT, and the completions it made before the timeout stay for the builder. The
session's own deadline (``timeout_seconds``, from submission) kills it the same way when
it comes before the agent timeout.

The harness here publishes CompletionRecords to ``polar.completions.<session>`` itself
(the bus-level contract the builder consumes); records made by the proxy from real model
calls are covered end to end by the proxy and builder tests.
"""

import os
import sys
import time

import pytest

from schemas import CompletionRecord, Outcome, SessionState, decode, encode
from schemas import subjects as S
from schemas.completion import Protocol, UpstreamMode
from schemas.task import BuilderSpec
from services.builder.logic import build_trajectory
from services.builder.strategies import default_registry
from services.scheduler import logic
from tests.helpers.node import Node, dead, leftover_dirs, session_procs, task, wait_until

pytestmark = pytest.mark.asyncio

PUBLISH = r"""
import asyncio, os, nats
async def main():
    nc = await nats.connect(os.environ["NATS_URL"])
    js = nc.jetstream()
    sid = os.environ["POLAR_SESSION_ID"]
    for line in open("records.jsonl", "rb").read().splitlines():
        await js.publish("polar.completions." + sid, line.replace(b"__SID__", sid.encode()))
    await nc.close()
asyncio.run(main())
"""
# Children of every kind, then a sleep far past the agent timeout.
FORKS = "sleep 300 & (sleep 301 &); setsid sleep 302 & sh -c 'trap \"\" TERM; sleep 303; :' & "
# Room for publish.py (a Python start, an import of nats, a connect) on a loaded machine:
# the timeout counts from the start, and the tree only forms after it.
AGENT_TIMEOUT = 5.0
GRACE = 0.5


def records() -> str:
    recs = [
        CompletionRecord(
            session_id="__SID__",
            seq=i,
            protocol=Protocol.OPENAI_CHAT,
            mode=UpstreamMode.CHAT,
            model="m",
            prompt_ids=[1, 2, 3 + i],
            output_ids=[7, 8],
            output_logprobs=[-0.5, -0.25],
        )
        for i in range(3)
    ]
    return "\n".join(encode(r).decode() for r in recs)


async def stored_completions(bus, session_id: str) -> list[CompletionRecord]:
    sub = await bus.js.pull_subscribe(S.completions(session_id), stream=S.STREAM_COMPLETIONS)
    try:
        msgs = await sub.fetch(10, timeout=2)
    finally:
        await sub.unsubscribe()
    return [decode(m.data, CompletionRecord) for m in msgs]


async def test_timeout_kills_the_tree_and_keeps_the_completions(fresh_servers, tmp_path):
    nats_url, redis_url = fresh_servers
    work = tmp_path / "work"
    node = await Node.start(nats_url, redis_url, work, executor={"kill_grace_seconds": GRACE})
    try:
        spec = task(
            "tmo",
            agent_timeout_seconds=AGENT_TIMEOUT,
            timeout_seconds=120,
            runtime={
                "backend": "local",
                "network": "host",  # the harness publishes its records to NATS itself
                "prepare": [
                    {"action": "upload_file", "dest": "publish.py", "content": PUBLISH},
                    {"action": "upload_file", "dest": "records.jsonl", "content": records()},
                ],
            },
            agent={
                "harness": "shell",
                # `a && b && sleep 300 &` would background the whole and-list, publish
                # included: each step ends before the forks begin.
                "command": f"{sys.executable} publish.py || exit 1; echo published; "
                f"{FORKS} sleep 304",
                "env": {"NATS_URL": nats_url},
            },
        )
        [session] = await node.scheduler.accept(logic.with_task_id(spec))
        sid = session.session_id

        # The tree is up: 7 processes (sh, 5 sleeps, the trapping sh), in 2+ sessions.
        pids = await wait_until(
            lambda: (p := session_procs(sid)) and len(p) >= 7 and p, 20, "the forked tree"
        )
        assert len({os.getsid(p) for p in pids}) >= 2  # one child left with setsid
        running_at = time.monotonic()

        await node.wait_finished(1, timeout=30)
        ended_after = time.monotonic() - running_at
        ev = node.finished[sid]
        assert ev.outcome == Outcome.TIMEOUT and "agent timeout" in ev.reason
        assert "published" in ev.artifacts.stdout_tail
        assert ended_after < AGENT_TIMEOUT + GRACE + 5  # killed on time, not after 300 s

        assert all(dead(p) for p in pids), [p for p in pids if not dead(p)]
        assert session_procs(sid) == []
        state = await node.registry.get_session(sid)
        assert (state.state, state.outcome) == (SessionState.POSTRUN, Outcome.TIMEOUT)
        assert leftover_dirs(work) == []

        # What the harness sent before the timeout is still there for the builder.
        kept = await stored_completions(node.bus, sid)
        assert [(r.session_id, r.seq, r.output_ids) for r in kept] == [
            (sid, i, [7, 8]) for i in range(3)
        ]
        # and the builder's own code builds the timed-out session's trajectory from them
        traj = build_trajectory(ev, BuilderSpec(name="per_request"), kept, default_registry())
        assert traj.outcome == Outcome.TIMEOUT and traj.intact and traj.reward == 0.0
        assert [t.response_ids for t in traj.traces] == [[7, 8]] * 3
    finally:
        await node.stop()


async def test_the_session_deadline_kills_the_tree_before_the_agent_timeout(
    fresh_servers, tmp_path
):
    nats_url, redis_url = fresh_servers
    work = tmp_path / "work"
    node = await Node.start(nats_url, redis_url, work, executor={"kill_grace_seconds": GRACE})
    try:
        # the agent may run as long as the whole session, but a slow INIT (4 s) leaves it
        # less: the session's deadline binds first. The 6 s left must hold the rest of INIT,
        # the agent's start and its forks on a loaded machine (5 s with 2.5 s of INIT was
        # not always enough for the tree to form before the deadline ended the session).
        deadline_s = 10.0
        spec = task(
            "ddl",
            agent_timeout_seconds=deadline_s,
            timeout_seconds=deadline_s,
            runtime={
                "backend": "local",
                "prepare": [{"action": "exec", "command": "sleep 4"}],
            },
            agent={"harness": "shell", "command": f"{FORKS} sleep 304"},
        )
        submitted = time.monotonic()
        [session] = await node.scheduler.accept(logic.with_task_id(spec))
        sid = session.session_id
        pids = await wait_until(
            lambda: (p := session_procs(sid)) and len(p) >= 7 and p, 20, "the forked tree"
        )
        await node.wait_finished(1, timeout=30)
        took = time.monotonic() - submitted
        ev = node.finished[sid]
        assert ev.outcome == Outcome.TIMEOUT and "session deadline" in ev.reason, ev.reason
        assert took < deadline_s + GRACE + 5  # on time, not after the agent's 600 s
        assert all(dead(p) for p in pids), [p for p in pids if not dead(p)]
        assert session_procs(sid) == [] and leftover_dirs(work) == []
    finally:
        await node.stop()
