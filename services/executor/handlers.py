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

import msgspec
from nats.aio.msg import Msg

from proxy.callcount import numbered_calls
from schemas import Artifacts, NodeHeartbeat, Outcome, ReadyWork, SessionState, decode
from schemas import subjects as S
from services.common.bus import Bus
from services.common.plugins import Registry as PluginRegistry
from services.common.redact import known_secrets, redact, scrub_known, scrub_known_struct
from services.common.registry import Registry
from services.executor.config import ExecutorConfig
from services.node import artifacts as A
from services.node.harnesses import Harness, HarnessContext
from services.node.heartbeat import (
    STAGE_RESULTS,
    STAGE_SECONDS,
    STAGE_WAIT,
    node_stages,
    send_heartbeat,
)
from services.node.prewarm import ROLE as PREWARM_ROLE
from services.node.prewarm import Prewarm, wants_prewarm
from services.node.reaper import finish_session, keeps_live
from services.node.session import SessionPaths, harness_context, node_runtime
from services.runtimes.base import OutputBuffer, Runtime

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
    attempt: int
    runtime: Runtime
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    cancel_reason: str = ""
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # no longer in ``running``
    released: bool = False  # its lease dropped with its POSTRUN change

    def cancel(self, reason: str) -> None:
        """End the run without finishing it: kill the harness, stop the runtime."""
        self.cancel_reason = reason
        self.cancelled.set()


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
        if (held := self.running.get(work.session_id)) is not None:
            if held.attempt >= work.attempt:  # a duplicate delivery while it runs here
                return
            # An older attempt's run, on past its lease (retried, and this attempt came
            # back to this node): stopped, not left running beside it; the hand-off is
            # no duplicate, skipping it left the new attempt READY until its deadline.
            held.cancel(f"superseded by attempt {work.attempt}")
            await held.gone.wait()
        spec = await self.registry.task_spec(work.task_id)
        session = await self.registry.get_session(work.session_id)
        if spec is None or session is None or session.attempt != work.attempt:
            return  # gone, or the hand-over of an earlier attempt (the runtime is not its)
        runtime = node_runtime(
            self.config,
            spec.runtime,
            work.session_id,
            work.runtime_id,
            harness=spec.agent.harness,
            token=session.token,  # adopted (from the pool, or after a restart): pinned again
        )
        run = RunningSession(work.session_id, work.attempt, runtime)
        # Found by a cancel message from before the change on: a cancel of the RUNNING
        # session cannot land between the change and this (no re-read of the session
        # after it). One that finds it still READY makes the change below fail.
        self.running[work.session_id] = run
        try:
            started = await self.registry.transition(
                work.session_id,
                ST.RUNNING,
                from_=[ST.READY],
                expect_attempt=work.attempt,
                lease=(self.owner, self.config.lease_seconds),  # one step: never unheld
            )
        except BaseException:
            # not started (e.g. NOREPLICAS in a failover): the redelivery must find it
            # not running here, or it is skipped as a duplicate and the session waits
            # READY until its deadline (tests/cluster: 6 sessions ended ERROR so)
            self._forget(run)
            raise
        if not started.ok:
            self._forget(run)
            if started.from_state in ABANDONED:  # cancelled or ended in the READY buffer
                await runtime.stop()
            return
        STAGE_WAIT.labels(self.node, "run").observe(max(0.0, time.time() - work.ts))
        t0 = time.monotonic()
        ended = False
        try:
            outcome = await self._run_session(run, spec, session, work)
            ended = True
        finally:
            self._forget(run)
            # else the lease runs out and a reaper ends and cleans the session
            if ended and not run.released:  # not dropped with a POSTRUN change
                # its own lease only: cut off past it, the session may be another
                # attempt's now, held by a pool elsewhere (dropping that lease had a
                # reaper retry the new attempt at once, as held by nobody)
                await self.registry.release(work.session_id, self.owner, work.attempt)
            STAGE_SECONDS.labels(self.node, "run").observe(time.monotonic() - t0)
        STAGE_RESULTS.labels(self.node, "run", outcome.value).inc()

    def _forget(self, run: RunningSession) -> None:
        if self.running.get(run.session_id) is run:  # not a newer attempt's run
            del self.running[run.session_id]
        run.gone.set()

    async def _run_session(self, run: RunningSession, spec, session, work: ReadyWork) -> Outcome:
        """Run, collect, finish. Every path stops both the runtime and a prewarmed eval
        runtime, except a finish event that hands one of them to the evaluator."""
        prewarm = self._start_prewarm(spec, session.session_id, work.attempt)
        kept: Runtime | None = None  # named in the finish event: the evaluator stops it
        try:
            result, arts = await self._run_and_collect(run, spec, session)
            if result.outcome == Outcome.CANCELLED:  # cancelled, or a later attempt took over
                return result.outcome
            if keeps_live(spec):
                kept = run.runtime
            elif prewarm is not None:
                kept = await prewarm.ready()
            # Stopped before the event: an evaluator may then start its own eval runtime.
            await self._stop_unkept(run, prewarm, kept)
            eval_rt = kept.runtime_id if kept else None
            if not await self._finish(run, session, work, result, arts, eval_rt):
                kept = None  # cancelled or ended meanwhile: nobody takes it over
            return result.outcome
        except Exception as exc:  # noqa: BLE001 - an executor fault ends it as ERROR
            log.exception("run of %s failed", session.session_id)
            kept = None
            await self._stop_unkept(run, prewarm, None)
            reason = f"executor failed: {exc}"[:2000]
            error = RunResult(Outcome.ERROR, reason, None, b"", b"")
            await self._finish(run, session, work, error, Artifacts(), None)
            return Outcome.ERROR
        finally:  # cancelled (node stopping), or the finish lost a race
            await self._stop_unkept(run, prewarm, kept)

    async def _stop_unkept(self, run: RunningSession, prewarm, kept: Runtime | None) -> None:
        grace = self.config.kill_grace_seconds
        if kept is not run.runtime:
            with contextlib.suppress(Exception):
                await run.runtime.stop(grace)
        if prewarm is not None and kept is not prewarm.runtime:
            with contextlib.suppress(Exception):
                await prewarm.stop()

    async def _run_and_collect(self, run: RunningSession, spec, session):
        paths = SessionPaths.of(self.config.work_dir, session.session_id)
        try:
            harness = self.harnesses.create(spec.agent.harness)
            ctx = harness_context(session, spec, run.runtime, self.config.proxy_url, paths)
        except Exception as exc:  # noqa: BLE001 - it ends as ERROR; never stuck in RUNNING
            log.warning("harness of %s could not be set up: %s", session.session_id, exc)
            reason = f"harness could not be set up: {exc}"[:2000]
            return RunResult(Outcome.ERROR, reason, None, b"", b""), Artifacts()
        t0 = time.monotonic()
        try:
            result = await self._run_harness(run, harness, ctx, spec, session)
        except Exception as exc:  # noqa: BLE001 - it ends as ERROR; never stuck in RUNNING
            log.warning("harness of %s could not run: %s", session.session_id, exc)
            result = RunResult(
                Outcome.ERROR, f"harness could not run: {exc}"[:2000], None, b"", b""
            )
        STAGE_SECONDS.labels(self.node, "harness").observe(time.monotonic() - t0)
        if result.outcome == Outcome.CANCELLED:
            return result, Artifacts()
        known = known_secrets(ctx.token, spec)
        result = RunResult(
            result.outcome,
            redact(scrub_known(result.reason.encode(), known).decode()) if result.reason else None,
            result.exit_code,
            scrub_known(result.stdout, known),  # whole, before any tail is cut from it
            scrub_known(result.stderr, known),
        )
        return result, await self._collect(run.runtime, harness, ctx, result, spec, paths, known)

    async def _run_harness(self, run, harness, ctx: HarnessContext, spec, session) -> RunResult:
        if run.cancelled.is_set():
            return RunResult(Outcome.CANCELLED, run.cancel_reason, None, b"", b"")
        hrun = harness.run(ctx)
        if hrun is None:
            return RunResult(Outcome.COMPLETED, None, 0, b"", b"")
        left = session.deadline - time.time()
        budget = min(spec.agent_timeout, left)
        limit = "agent timeout" if spec.agent_timeout <= left else "session deadline"
        if budget <= 0:
            return RunResult(
                Outcome.TIMEOUT, "session deadline passed before the run", None, b"", b""
            )
        calls_before = await self._model_calls(session.session_id) if harness.calls_model else 0
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
            reason = f"{limit} after {budget:.0f}s: process tree killed"
            return RunResult(Outcome.TIMEOUT, reason, status.exit_code, out.data(), err.data())
        outcome, reason = harness.judge(
            status.exit_code, A.tail(out.data(), 65536), A.tail(err.data(), 65536)
        )
        silent = (
            outcome == Outcome.COMPLETED
            and harness.calls_model
            and await self._model_calls(session.session_id) == calls_before
        )
        if silent:
            outcome = Outcome.ERROR
            reason = f"{harness.name} exited {status.exit_code} without calling the model"
        return RunResult(outcome, reason, status.exit_code, out.data(), err.data())

    async def _model_calls(self, session_id: str) -> int:
        return await numbered_calls(self.registry.redis, session_id)

    async def _collect(
        self, runtime, harness, ctx, result: RunResult, spec, paths, known: list[str]
    ) -> Artifacts:
        cfg = self.config
        paths.logs.mkdir(parents=True, exist_ok=True)
        (paths.logs / "stdout.log").write_bytes(result.stdout)  # scrubbed already
        (paths.logs / "stderr.log").write_bytes(result.stderr)
        diff, logs, files = "", {}, {}
        if A.takes_diff(spec):
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
        found = Artifacts(
            exit_code=result.exit_code,
            stdout_tail=A.tail(result.stdout, cfg.tail_bytes),
            stderr_tail=A.tail(result.stderr, cfg.tail_bytes),
            diff=diff,
            logs=logs,
            files=files,
            harness=harness.name,
            harness_version=A.installed_version(logs) or harness.version(ctx),
            protocol=harness.protocol,
        )
        # The session's token is in CLI logs and error text (its base URL); the diff
        # stays as the agent left it, since evaluators apply it to grade the work.
        return msgspec.structs.replace(scrub_known_struct(found, known), diff=diff)

    async def _finish(
        self, run: RunningSession, session, work, result: RunResult, arts: Artifacts, eval_rt
    ) -> bool:
        finished = await finish_session(
            self.registry,
            self.bus,
            session,
            work.attempt,
            result.outcome,
            result.reason,
            arts,
            eval_rt,
            node=self.node,
            release_lease=self.owner,  # its own only, as ``release(owner=...)``
        )
        run.released = run.released or finished
        return finished

    def _start_prewarm(self, spec, session_id: str, attempt: int) -> Prewarm | None:
        if not wants_prewarm(spec):
            return None
        rt = node_runtime(
            self.config, spec.runtime, session_id, role=PREWARM_ROLE, attempt=attempt,
            harness=spec.agent.harness,
        )  # fmt: skip
        return Prewarm(rt, spec.runtime.prepare)

    # -- cancellation, leases, heartbeats ---------------------------------------------
    async def subscribe(self) -> list:
        """Core-NATS subscriptions the executor needs (the caller unsubscribes them)."""
        return [await self.bus.nc.subscribe(S.session_cancel("*"), cb=self.on_cancel)]

    async def on_cancel(self, msg: Msg) -> None:
        sid = msg.subject.rsplit(".", 1)[-1]
        run = self.running.get(sid)
        if run is not None:
            run.cancel(msg.data.decode("utf-8", "replace") or "cancelled")

    async def renew_leases(self) -> None:
        lost = await self.registry.hold(list(self.running), self.owner, self.config.lease_seconds)
        if lost:
            await self._stop_superseded(lost)

    async def _stop_superseded(self, lost: list[str]) -> None:
        """Stop the runs of sessions that went on to a later attempt (retried while this
        executor was cut off past its lease). Their finish is fenced and the retry took
        their harness's token, so a harness left running only made calls the proxy
        refuses, and its runtime's end could come at any time. A lost lease alone is not
        enough: a run is in ``running`` just before its READY -> RUNNING takes it."""
        sessions = await self.registry.get_sessions(lost)
        for sid, now in zip(lost, sessions, strict=True):
            run = self.running.get(sid)
            if run is None or (now is not None and now.attempt == run.attempt):
                continue
            at = f"attempt {now.attempt}" if now is not None else "gone"
            log.warning("stopping %s attempt %d: its session is %s", sid, run.attempt, at)
            run.cancel(f"superseded: the session is {at}")

    async def heartbeat(self) -> None:
        beat = NodeHeartbeat(
            ts=time.time(),
            node=self.node,
            service="executor",
            stages=await node_stages(self.registry, self.node, EXECUTOR_STAGES),
            capacity={"RUNNING": self.config.max_run},
        )
        await send_heartbeat(self.bus, self.registry, beat)
