"""The harness executor's I/O shell (RUNNING stage of one node).

Takes READY sessions of its node (at most ``max_run`` at once: the consumer's
concurrency), runs the harness with the agent timeout and the session deadline enforced
on the whole process tree, collects artifacts, publishes SessionFinished and always
stops the runtime. Leases in Redis let anyone end and clean the sessions of a node that
died (``reap``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from schemas import Artifacts, NodeHeartbeat, Outcome, ReadyWork, SessionState, decode
from schemas import subjects as S
from services.common.bus import Bus
from services.common.node import (
    STAGE_RESULTS,
    STAGE_SECONDS,
    STAGE_WAIT,
    SessionPaths,
    harness_context,
    node_runtime,
    node_stages,
    send_heartbeat,
)
from services.common.plugins import Registry as PluginRegistry
from services.common.registry import Registry
from services.executor import artifacts as A
from services.executor.config import ExecutorConfig
from services.executor.harnesses import Harness, HarnessContext
from services.executor.reaper import finish_session
from services.runtimes.base import OutputBuffer, Runtime
from services.runtimes.prepare import run_prepare

log = logging.getLogger(__name__)
ST = SessionState
EXECUTOR_STAGES = {"RUNNING": ST.RUNNING, "POSTRUN": ST.POSTRUN}
# A hand-over that finds its session in one of these states: the runtime waits for
# nobody, stop it. (In any other state someone else holds it: a duplicate delivery while
# it runs, a newer attempt, or an evaluator on the live runtime.)
ABANDONED = (ST.CANCELLED, ST.ERROR)


@dataclass
class RunningSession:
    session_id: str
    runtime: Runtime
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    cancel_reason: str = ""


@dataclass(frozen=True)
class RunResult:  # how one harness run ended
    outcome: Outcome
    reason: str | None
    exit_code: int | None
    stdout: bytes
    stderr: bytes


class Executor:
    def __init__(
        self,
        bus: Bus,
        registry: Registry,
        config: ExecutorConfig,
        harnesses: PluginRegistry[Harness],
    ) -> None:
        self.bus, self.registry, self.config, self.harnesses = bus, registry, config, harnesses
        self.node = config.node
        self.owner = f"executor:{self.node}:{uuid.uuid4().hex[:8]}"
        self.running: dict[str, RunningSession] = {}

    # -- one session --------------------------------------------------------------------
    async def on_ready(self, msg: Msg) -> None:
        work = decode(msg.data, ReadyWork)
        if work.session_id in self.running:  # a duplicate delivery while it runs here
            return
        task = await self.registry.get_task(work.task_id)
        session = await self.registry.get_session(work.session_id)
        if task is None or session is None or session.attempt != work.attempt:
            return  # gone, or the hand-over of an earlier attempt (the runtime is not its)
        runtime = node_runtime(self.config, task.spec.runtime, work.session_id, work.runtime_id)
        started = await self.registry.transition(
            work.session_id, ST.RUNNING, from_=[ST.READY], expect_version=None
        )
        if not started.ok:
            if started.from_state in ABANDONED:  # cancelled or ended in the READY buffer
                await runtime.stop()
            return
        run = RunningSession(work.session_id, runtime)
        self.running[work.session_id] = run  # from here on a cancel message finds it
        STAGE_WAIT.labels(self.node, "run").observe(max(0.0, time.time() - work.ts))
        t0 = time.monotonic()
        try:
            await self.registry.hold([work.session_id], self.owner, self.config.lease_seconds)
            await self._cancelled_meanwhile(run)
            outcome = await self._run_session(run, task.spec, session, work)
        finally:
            self.running.pop(work.session_id, None)
            await self.registry.release(work.session_id)
            STAGE_SECONDS.labels(self.node, "run").observe(time.monotonic() - t0)
        STAGE_RESULTS.labels(self.node, "run", outcome.value).inc()

    async def _cancelled_meanwhile(self, run: RunningSession) -> None:
        """A cancel that landed between the RUNNING transition and ``self.running``."""
        now = await self.registry.get_session(run.session_id)
        if now is None or now.state != ST.RUNNING:
            run.cancel_reason = (now.reason if now else None) or "cancelled"
            run.cancelled.set()

    async def _run_session(self, run: RunningSession, spec, session, work: ReadyWork) -> Outcome:
        paths = SessionPaths.of(self.config.work_dir, session.session_id)
        harness = self.harnesses.create(spec.agent.harness)
        ctx = harness_context(session, spec, run.runtime, self.config.proxy_url, paths)
        prewarm = self._start_prewarm(spec, session.session_id)
        t0 = time.monotonic()
        try:
            result = await self._run_harness(run, harness, ctx, spec, session)
        except Exception as exc:  # noqa: BLE001 - it ends as ERROR; never stuck in RUNNING
            log.warning("harness of %s could not run: %s", session.session_id, exc)
            result = RunResult(
                Outcome.ERROR, f"harness could not run: {exc}"[:2000], None, b"", b""
            )
        STAGE_SECONDS.labels(self.node, "harness").observe(time.monotonic() - t0)
        keep_live = spec.evaluator.runtime == "live" and spec.evaluator.name != "session_completed"
        arts = await self._collect(run.runtime, harness, ctx, result, spec, paths)
        eval_runtime_id = await _finish_prewarm(prewarm)
        if keep_live and result.outcome != Outcome.CANCELLED:
            eval_runtime_id = run.runtime.runtime_id  # the evaluator stops it
        else:
            await run.runtime.stop(self.config.kill_grace_seconds)
        if result.outcome != Outcome.CANCELLED:  # else the canceller moved it to CANCELLED
            await self._finish(session, work, result, arts, eval_runtime_id)
        return result.outcome

    async def _run_harness(self, run, harness, ctx: HarnessContext, spec, session) -> RunResult:
        if run.cancelled.is_set():
            return RunResult(Outcome.CANCELLED, run.cancel_reason, None, b"", b"")
        hrun = harness.run(ctx)
        if hrun is None:
            return RunResult(Outcome.COMPLETED, None, 0, b"", b"")
        budget = min(spec.agent_timeout, session.deadline - time.time())
        if budget <= 0:
            return RunResult(
                Outcome.TIMEOUT, "session deadline passed before the run", None, b"", b""
            )
        out, err = OutputBuffer(), OutputBuffer()
        proc = await run.runtime.spawn(
            hrun.argv, cwd=hrun.cwd, env=hrun.env, stdout=out, stderr=err, timeout=budget + 30
        )
        waiter = asyncio.create_task(proc.wait(budget, grace=self.config.kill_grace_seconds))
        cancel = asyncio.create_task(run.cancelled.wait())
        await asyncio.wait({waiter, cancel}, return_when=asyncio.FIRST_COMPLETED)
        cancel.cancel()
        if run.cancelled.is_set() and not waiter.done():
            await proc.kill()
            waiter.cancel()
            return RunResult(Outcome.CANCELLED, run.cancel_reason, None, out.data(), err.data())
        status = await waiter
        if status.timed_out:
            reason = f"agent timeout after {budget:.0f}s: process tree killed"
            return RunResult(Outcome.TIMEOUT, reason, status.exit_code, out.data(), err.data())
        outcome, reason = harness.judge(
            status.exit_code, A.tail(out.data(), 65536), A.tail(err.data(), 65536)
        )
        return RunResult(outcome, reason, status.exit_code, out.data(), err.data())

    async def _collect(self, runtime, harness, ctx, result: RunResult, spec, paths) -> Artifacts:
        cfg = self.config
        paths.logs.mkdir(parents=True, exist_ok=True)
        (paths.logs / "stdout.log").write_bytes(result.stdout)
        (paths.logs / "stderr.log").write_bytes(result.stderr)
        diff, logs, files = "", {}, {}
        with contextlib.suppress(Exception):
            d = await runtime.exec(A.diff_command(harness), timeout=120)
            if d.ok:
                diff = d.stdout[: cfg.max_diff_bytes].decode("utf-8", "replace")
        for path in A.log_paths(harness, ctx):
            with contextlib.suppress(Exception):
                for name, text in A.untar_texts(
                    await runtime.download_tar(path), cfg.max_log_bytes
                ).items():
                    logs[f"{path.rsplit('/', 1)[-1]}/{name}"] = text
        for name in spec.agent.output_files:
            with contextlib.suppress(Exception):
                files[name] = A.tail(await runtime.download(name), cfg.max_log_bytes)
        return Artifacts(
            exit_code=result.exit_code,
            stdout_tail=A.tail(result.stdout, cfg.tail_bytes),
            stderr_tail=A.tail(result.stderr, cfg.tail_bytes),
            diff=diff,
            logs=logs,
            files=files,
            harness=harness.name,
            harness_version=harness.version(ctx),
            protocol=harness.protocol,
        )

    async def _finish(self, session, work, result: RunResult, arts: Artifacts, eval_rt) -> None:
        await finish_session(
            self.registry,
            self.bus,
            session,
            work.attempt,
            result.outcome,
            result.reason,
            arts,
            eval_rt,
        )

    def _start_prewarm(self, spec, session_id: str) -> asyncio.Task | None:
        ev = spec.evaluator
        if not (ev.prewarm and ev.runtime == "fresh"):
            return None

        async def prewarm() -> str:
            rt = node_runtime(self.config, spec.runtime, session_id, role="eval")
            await rt.start()
            logs = await run_prepare(rt, spec.runtime.prepare)
            if not all(a.ok for a in logs):
                await rt.stop()
                raise RuntimeError("eval runtime prepare failed")
            return rt.runtime_id

        return asyncio.create_task(prewarm())

    # -- cancellation, leases, heartbeats ---------------------------------------------
    async def subscribe(self) -> list:
        """Core-NATS subscriptions the executor needs (the caller unsubscribes them)."""
        return [await self.bus.nc.subscribe(S.session_cancel("*"), cb=self.on_cancel)]

    async def on_cancel(self, msg: Msg) -> None:
        sid = msg.subject.rsplit(".", 1)[-1]
        run = self.running.get(sid)
        if run is not None:
            run.cancel_reason = msg.data.decode("utf-8", "replace") or "cancelled"
            run.cancelled.set()

    async def renew_leases(self) -> None:
        await self.registry.hold(list(self.running), self.owner, self.config.lease_seconds)

    async def heartbeat(self) -> None:
        beat = NodeHeartbeat(
            ts=time.time(),
            node=self.node,
            service="executor",
            stages=await node_stages(self.registry, self.node, EXECUTOR_STAGES),
            capacity={"RUNNING": self.config.max_run},
        )
        await send_heartbeat(self.bus, self.registry, beat)


async def _finish_prewarm(task: asyncio.Task | None) -> str | None:
    if task is None:
        return None
    try:
        return await task
    except Exception as exc:  # noqa: BLE001 - the evaluator will start its own
        log.warning("eval prewarm failed: %s", exc)
        return None
