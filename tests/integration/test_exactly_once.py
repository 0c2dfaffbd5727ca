"""kill -9 the builder and the evaluator at random points during a 100-session run:
after restarts, every session's trajectory arrives on polar.trajectories.<task> exactly once."""

import asyncio
import os
import random
from collections import Counter

import pytest

from schemas import (
    BuilderSpec,
    CompletionRecord,
    EvaluatorSpec,
    Outcome,
    Protocol,
    SessionFinished,
    SessionState,
    TaskRequest,
    Trajectory,
    UpstreamMode,
    decode,
    encode,
)
from schemas import subjects as S
from services.common.bus import Bus
from services.common.registry import Registry
from tests.helpers.procs import ServiceProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(400)]
N = 100


def records(sid: str) -> list[CompletionRecord]:
    out, prompt = [], [1, 2, 3, 4]
    for seq in range(3):
        output = [100 + seq, 101 + seq, 7]
        out.append(
            CompletionRecord(
                session_id=sid,
                seq=seq,
                protocol=Protocol.OPENAI_CHAT,
                mode=UpstreamMode.TOKEN,
                model="m",
                prompt_ids=list(prompt),
                output_ids=output,
                output_logprobs=[-0.5] * 3,
                finish_reason="stop",
                weight_version="1",
            )
        )
        prompt = prompt + output + [9, 9, 9]
    return out


async def test_builder_and_evaluator_killed_at_random(fresh_servers, tmp_path):
    nats_url, redis_url = fresh_servers
    bus = await Bus.open(nats_url, "exactly-once")
    reg = Registry.from_url(redis_url, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    plugins = "tests.helpers.traced_plugins"
    task = TaskRequest(
        task_id="once",
        instruction="x",
        num_samples=N,
        builder=BuilderSpec(name=f"{plugins}:TracedBuilder"),
        evaluator=EvaluatorSpec(name=f"{plugins}:TracedEvaluator"),
    )
    trace = tmp_path / "starts.log"
    os.environ["POLAR_TEST_TRACE"] = str(trace)  # inherited by the service processes
    _, sessions = await reg.create_task(task)
    for s in sessions:
        for st in ("INITIALIZING", "READY", "RUNNING"):
            await reg.transition(s.session_id, SessionState(st), node="node0")
        await reg.transition(s.session_id, SessionState.POSTRUN, outcome="completed")
        for r in records(s.session_id):
            await bus.publish(
                S.completions(s.session_id), encode(r), msg_id=f"{s.session_id}:{r.seq}"
            )

    cfg = {"nats_url": nats_url, "redis_url": redis_url, "ack_wait_seconds": 2.0}
    logs = tmp_path / "logs"
    builder = ServiceProcess("services.builder.main:create_app", cfg, logs).start()
    evaluator = ServiceProcess(
        "services.evaluator.main:create_app", {**cfg, "work_dir": str(tmp_path / "work")}, logs
    ).start()
    try:
        for s in sessions:
            ev = SessionFinished(session_id=s.session_id, task_id="once", outcome=Outcome.COMPLETED)
            await bus.publish(S.SESSIONS_FINISHED, encode(ev), msg_id=f"finished:{s.session_id}:0")
        rng = random.Random(7)

        async def started(kind: str) -> int:
            return sum(1 for line in trace.read_text().splitlines() if line.startswith(kind))

        for victim, kind in [(builder, "build"), (evaluator, "eval")] * 3:
            base = await started(kind) if trace.exists() else 0
            target = min(base + rng.randint(3, 8), N - 10)
            for _ in range(600):  # let it get into its work first (bounded wait)
                if trace.exists() and await started(kind) >= target:
                    break
                await asyncio.sleep(0.02)
            victim.kill()  # kill -9, mid-work
            victim.start()
        for _ in range(1200):
            if (await reg.task_counts("once")).get("COMPLETED") == N:
                break
            await asyncio.sleep(0.1)
        assert await reg.task_counts("once") == {"COMPLETED": N}
        await asyncio.sleep(3)  # a late duplicate would have arrived by now
        seen = Counter()
        info = await bus.js.stream_info(
            S.STREAM_TRAJECTORIES, subjects_filter=S.trajectories("once")
        )
        sub = await bus.js.subscribe(S.trajectories("once"), ordered_consumer=True)
        for _ in range(info.state.messages):
            msg = await sub.next_msg(timeout=5)
            seen[decode(await bus.payload(msg), Trajectory).session_id] += 1
        await sub.unsubscribe()
        assert len(seen) == N and set(seen.values()) == {1}
        starts = Counter(trace.read_text().splitlines())
        redone = [k for k, n in starts.items() if n > 1]
        assert any(k.startswith("build ") for k in redone), "no kill interrupted a build"
        assert any(k.startswith("eval ") for k in redone), "no kill interrupted an evaluation"
    finally:
        os.environ.pop("POLAR_TEST_TRACE", None)
        builder.stop()
        evaluator.stop()
        await reg.close()
        await bus.close()
