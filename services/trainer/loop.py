"""The training loop (the I/O shell around ``policy.train_step``).

Per step: keep ``groups_per_step + rollout_ahead`` training tasks in flight while
collecting (only ``rollout_ahead`` once the step's groups are in, so with 0 nothing is
sampled while training); take ``groups_per_step`` complete groups; one optimizer step;
write the checkpoint (weights + which groups it trained); only then commit the groups;
push the weights to the engines (every ``sync_every`` steps); evaluate the held-out set
greedily through the same stack when due.

Crash safety: a group is committed after the checkpoint that names it, so a restart
resumes from LATEST, acks groups it already trained on (at most once) and gets the
uncommitted ones again (none lost). Task ids are derived from the task index, so tasks
resubmitted after a restart are the same tasks (the bus and the scheduler dedupe them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import torch
from nats.js.errors import NotFoundError, ObjectNotFoundError

from schemas import subjects as S
from services.client import TrajectoryClient
from services.client.client import Group
from services.common.bus import Bus
from services.engine.modelconfig import ModelLoadError
from services.trainer import checkpoint as ck
from services.trainer import metrics
from services.trainer.batch import (
    GroupCounts,
    group_samples,
    image_digests,
    trainable_traces,
    usable,
)
from services.trainer.config import ConfigError, TrainerConfig
from services.trainer.policy import MismatchError, Policy, StepSettings, train_step
from services.trainer.submit import Submitter
from services.trainer.sync import push_weights
from services.trainer.tasks import TaskSource, make_task, task_id

log = logging.getLogger(__name__)
OnRecord = Callable[[dict], None]
FAULT_ENV = "POLAR_TRAINER_FAULT"  # "after_checkpoint:<step>": kill -9 itself there (tests)


def fault_point(point: str, step: int) -> None:
    """Crash tests: SIGKILL this process at a named point, as a power cut would."""
    if os.environ.get(FAULT_ENV) == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def settings_of(cfg: TrainerConfig) -> StepSettings:
    return StepSettings(
        objective=cfg.objective,
        eps_low=cfg.clip_eps,
        eps_high=cfg.eps_high,
        ratio_cap=cfg.ratio_cap,
        kl_coef=cfg.kl_coef,
        max_staleness=cfg.max_staleness,
        stale_policy=cfg.stale_policy,
        stale_weight=cfg.stale_weight,
        dr_grpo_max_tokens=cfg.dr_grpo_max_tokens,
        skip_zero_advantage=cfg.skip_zero_advantage,
        mismatch_threshold=cfg.mismatch_threshold,
        grad_clip=cfg.grad_clip,
    )


def eval_due(cfg: TrainerConfig, step: int) -> bool:
    e = cfg.eval
    if e.every == 0 and not e.at_start and not e.at_end:
        return False
    if step == 0:
        return e.at_start
    if step == cfg.steps and e.at_end:
        return True
    return e.every > 0 and step % e.every == 0


def task_score(t) -> float:
    """A held-out member's score: its traces' rewards averaged (one question each), else
    its session reward; a failed evaluation scores 0."""
    if not usable(t):
        return 0.0
    rewards = [tr.reward for tr in trainable_traces(t) if tr.reward is not None]
    return float(sum(rewards) / len(rewards)) if rewards else float(t.reward)


class Trainer:
    def __init__(self, cfg: TrainerConfig, on_record: OnRecord | None = None) -> None:
        self.cfg, self.on_record = cfg, on_record
        self.root = Path(cfg.checkpoint_dir)
        self.settings = settings_of(cfg)
        self.train_q: asyncio.Queue[Group] = asyncio.Queue()
        self.evals: dict[int, dict[str, Group]] = {}
        self.hold: list[Group] = []  # eval groups committed with the next state write
        self.prefix_train, self.prefix_eval = f"{cfg.run_id}-t", f"{cfg.run_id}-e"
        self.started = time.time()
        self.done = False
        self.error: str | None = None
        self.skipped_trained = 0  # redelivered groups acked because a checkpoint has them

    # -- setup ------------------------------------------------------------------------
    def _open_policy(self) -> None:
        torch.manual_seed(self.cfg.seed)
        torch.set_num_threads(self.cfg.threads)
        self.source = TaskSource.load(self.cfg.tasks, self.cfg.seed)
        try:
            self.policy = Policy(
                self.cfg.model_dir,
                lr=self.cfg.lr,
                weight_decay=self.cfg.weight_decay,
                device=self.cfg.device,
                reference=self.cfg.kl_coef > 0,
            )
        except ModelLoadError as exc:
            raise ConfigError(f"model_dir: {exc}") from None
        found = ck.latest(self.root)
        if found is None:
            self.state = ck.TrainerState(run_id=self.cfg.run_id)
            self.resumed = False  # step 0 is written once the run id is known to be new
        else:
            self.ckpt, self.state = found
            self.policy.load(self.ckpt)
            self.resumed = True
            if self.cfg.keep_best:  # a crash between the state and BEST's rename
                ck.mark_best(self.root, self.state)
            self._repair_log()

    def _repair_log(self) -> None:
        """Records the last checkpoint holds but the log lost (a crash between the two)."""
        have = {(r.get("type"), r.get("step")) for r in ck.read_log(self.cfg.log_file)}
        missing = [
            {**r, "restored": True}
            for r in self.state.records
            if (r["type"], r["step"]) not in have
        ]
        metrics.append_log(self.cfg.log_file, missing)

    async def _connect(self) -> None:
        cfg = self.cfg
        self.bus = await Bus.open(cfg.nats_url, f"polar-trainer-{cfg.run_id}")
        if not self.resumed:
            await self._check_new_run()
        self.client = await TrajectoryClient(
            cfg.nats_url,
            durable=self.durable,
            ack_wait=cfg.ack_wait_seconds,
            inactive_threshold=cfg.consumer_inactive_seconds,
        ).connect()
        self.submitter = await Submitter(self.bus, f"{cfg.run_id}-").start()
        self.http = httpx.AsyncClient(trust_env=False)
        self.reader = asyncio.create_task(self._read(), name="trainer-reader")

    @property
    def durable(self) -> str:
        return f"trainer-{self.cfg.run_id}"

    async def _check_new_run(self) -> None:
        """A fresh run must not reuse a run id the bus knows: its task ids would be
        deduplicated against the old run's and their groups are already acked, so the
        run would wait forever. The bus knows it by the run's consumer (a run that died),
        or by its first task's trajectories (a run that finished deleted its consumer)."""
        if await self._consumer_exists():
            why = f"consumer {self.durable} exists"
        elif await self._has_trajectories(task_id(self.cfg.run_id, "train", 0, 0)):
            why = "its trajectories are in the stream"
        else:
            return
        await self.bus.close()
        raise ConfigError(
            f"run_id {self.cfg.run_id!r} was used before on this bus ({why}) but "
            f"{self.root} has no checkpoint: give a new run_id, or the old run's "
            "checkpoint_dir to resume it"
        )

    async def _consumer_exists(self) -> bool:
        try:
            await self.bus.js.consumer_info(S.STREAM_TRAJECTORIES, self.durable)
        except NotFoundError:
            return False
        return True

    async def _has_trajectories(self, tid: str) -> bool:
        try:
            await self.bus.js.get_last_msg(S.STREAM_TRAJECTORIES, S.trajectories(tid))
        except NotFoundError:
            return False
        return True

    async def _close(self) -> None:
        self.reader.cancel()
        with contextlib.suppress(BaseException):
            await self.reader
        if self.cfg.cancel_on_exit and self.state.in_flight:
            with contextlib.suppress(Exception):
                await self.submitter.cancel(list(self.state.in_flight), "trainer run ended")
        with contextlib.suppress(Exception):
            await self.submitter.stop()
        if self.done:  # finished for good: its consumer would hold a backlog forever
            with contextlib.suppress(Exception):
                await self.client.delete_consumer()
        # a stack that went down meanwhile must not turn the run's result (a finished
        # run's checkpoint and log are written) into a failure at the goodbye
        for close in (
            lambda: self.client.close(release=not self.done),
            self.bus.close,
            self.http.aclose,
        ):
            try:
                await close()
            except Exception as exc:  # noqa: BLE001 - logged; the others still close
                log.warning("closing the trainer's connections: %s: %s", type(exc).__name__, exc)

    # -- groups in --------------------------------------------------------------------
    async def _read(self) -> None:
        trained = set(self.state.trained)
        async for group in self.client.groups(partial_after=self.cfg.partial_after_seconds):
            tid = group.task_id
            if tid in trained:
                self.skipped_trained += 1
                await group.commit()  # trained before a restart (the checkpoint says so)
            elif not tid.startswith(f"{self.cfg.run_id}-"):
                await group.commit()  # not this run's
            elif tid.startswith(self.prefix_train):
                trained.add(tid)
                await self.train_q.put(group)
            elif tid.startswith(self.prefix_eval):
                step = int(tid[len(self.prefix_eval) :].split("-")[0])
                if step in self.state.evals_done:
                    await group.commit()
                else:
                    self.evals.setdefault(step, {})[tid] = group
            else:
                await group.commit()

    def _check_reader(self) -> None:
        if self.reader.done():
            exc = self.reader.exception() if not self.reader.cancelled() else None
            raise RuntimeError(f"the trajectory reader stopped: {exc!r}")
        self.submitter.check()

    # -- tasks out --------------------------------------------------------------------
    def _outstanding(self, taken: int) -> int:
        return sum(1 for k in self.state.in_flight.values() if k == "train") - taken

    async def _top_up(self, taken: int) -> None:
        want = self.cfg.groups_per_step - taken + self.cfg.rollout_ahead
        trained = set(self.state.trained)
        while self._outstanding(taken) < want:
            i = self.state.next_task
            self.state.next_task += 1
            tid = task_id(self.cfg.run_id, "train", 0, i)
            if tid in trained:
                continue
            meta = {"trainer_run": self.cfg.run_id, "split": "train", "task_index": i}
            task = make_task(self.source.train_task(i), tid, self.cfg.group_size, meta)
            await self.submitter.submit(task)
            self.state.in_flight[tid] = "train"

    async def _take(self) -> tuple[list[Group], float]:
        t0, groups = time.perf_counter(), []
        while len(groups) < self.cfg.groups_per_step:
            await self._top_up(len(groups))
            self._check_reader()
            try:
                groups.append(await asyncio.wait_for(self.train_q.get(), 1.0))
            except TimeoutError:
                continue
        return groups, time.perf_counter() - t0

    # -- one step ---------------------------------------------------------------------
    def _samples(self, groups: list[Group]):
        counts, samples = GroupCounts(), []
        for g in groups:
            expected = g.trajectories[0].metadata.get("num_samples") if g.items else None
            samples += group_samples(
                g.trajectories,
                expected,
                self.cfg.objective,
                self.cfg.grouping,
                counts,
                self.cfg.tool_parse_failures,
            )
        return samples, counts

    async def _step(self) -> None:
        t_step = time.perf_counter()
        groups, wait = await self._take()
        samples, counts = self._samples(groups)
        await self._load_images(samples)
        version = self.state.step
        stats = await asyncio.to_thread(self._train, samples, version)
        ids = [g.task_id for g in groups]
        self.state.step += 1
        self.state.trained += ids
        for tid in ids:
            self.state.in_flight.pop(tid, None)
        rewards = counts.rewards
        rec = {
            "type": "step",
            "step": self.state.step,
            "trained_version": version,
            "time": time.time(),
            "elapsed_s": time.time() - self.started,
            "groups": ids,
            "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
            "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "counts": counts.as_dict(),
            **{k: v for k, v in vars(stats).items() if k != "train_seconds"},
            "sampled_tokens": sum(s.loss_tokens for s in samples),
            "mismatch_threshold": self.cfg.mismatch_threshold,
            "rollout_wait_s": wait,
            "updates": self.cfg.updates_per_batch,
            "train_s": stats.train_seconds,
            "train_tokens_per_s": stats.tokens / stats.train_seconds
            if stats.train_seconds
            else 0.0,
            "in_flight": len(self.state.in_flight),
        }
        t_ck = time.perf_counter()
        self._checkpoint(rec)
        rec["checkpoint_s"] = time.perf_counter() - t_ck
        fault_point("after_checkpoint", self.state.step)
        await self._commit(groups)
        t_sync = time.perf_counter()
        synced = None
        if self.state.step % self.cfg.sync_every == 0 or eval_due(self.cfg, self.state.step):
            synced = await self._sync()
        rec["sync_s"] = time.perf_counter() - t_sync
        rec["engine_version"] = synced
        rec["step_s"] = time.perf_counter() - t_step
        rec["sampled_tokens_per_s"] = rec["sampled_tokens"] / rec["step_s"]
        rec["skipped_trained"] = self.skipped_trained
        self._emit(rec)

    async def _load_images(self, samples: list) -> None:
        """The pixels of the images the batch's samples hold, from the object store
        (where the proxy put them by digest); the policy keeps only this batch's."""
        digests = image_digests(samples)
        self.policy.keep_images(digests)
        missing = sorted(digests - set(self.policy.pixels))
        if not missing:
            return
        store = await self.bus.blobs()
        for digest in missing:
            try:
                data = (await store.get(S.image_object(digest))).data
            except ObjectNotFoundError as exc:
                raise LookupError(
                    f"image {digest} of a trajectory is not in the object store (expired? "
                    "see the retention policy's object limits)"
                ) from exc
            self.policy.add_images({digest: data})

    def _train(self, samples: list, version: int):
        """``updates_per_batch`` optimizer steps on one batch; the first one's statistics
        (its mismatch check, its loss before any update), the time of all."""
        first = train_step(self.policy, samples, version, self.settings)
        for _ in range(self.cfg.updates_per_batch - 1):
            later = train_step(self.policy, samples, version, self.settings, check=False)
            first.train_seconds += later.train_seconds
        return first

    def _checkpoint(self, rec: dict) -> None:
        self.state.records = [rec]
        self.ckpt = ck.commit_checkpoint(self.root, self.state, self.policy.save)
        ck.prune(self.root, self.cfg.keep_checkpoints, self._protected())

    def _protected(self) -> tuple[str, ...]:
        best = self.state.best_step
        return (ck.step_name(best),) if self.cfg.keep_best and best is not None else ()

    def _write_state(self) -> None:
        ck.write_atomic(self.ckpt / ck.STATE_FILE, msgspec.json.encode(self.state))

    async def _commit(self, groups: list[Group]) -> None:
        for g in [*groups, *self.hold]:
            await g.commit()
        self.hold = []

    async def _sync(self) -> str:
        return await push_weights(
            self.http,
            self.cfg.proxy_url,
            str(self.ckpt.resolve()),
            str(self.state.step),
            admin_token=self.cfg.admin_token,
        )

    def _emit(self, rec: dict) -> None:
        # the step record is in the checkpoint already; the log gets the timings too
        metrics.append_log(self.cfg.log_file, [rec])
        (metrics.observe_step if rec["type"] == "step" else metrics.observe_eval)(rec)
        if self.on_record is not None:
            self.on_record(rec)

    def _emit_resume(self) -> None:
        rec = {
            "type": "resume",
            "step": self.state.step,
            "time": time.time(),
            "checkpoint": self.ckpt.name,
            "trained_groups": len(self.state.trained),
            "in_flight": len(self.state.in_flight),
        }
        metrics.append_log(self.cfg.log_file, [rec])
        if self.on_record is not None:
            self.on_record(rec)

    # -- held-out evaluation ----------------------------------------------------------
    async def _evaluate(self, step: int) -> dict:
        e, t0 = self.cfg.eval, time.perf_counter()
        ids = []
        over = {**e.overrides, "priority": e.priority}
        for i, template in enumerate(self.source.heldout):
            tid = task_id(self.cfg.run_id, "eval", step, i)
            meta = {"trainer_run": self.cfg.run_id, "split": "heldout", "eval_step": step}
            await self.submitter.submit(make_task(template, tid, e.num_samples, meta, over))
            ids.append(tid)
        deadline = time.monotonic() + e.timeout_seconds
        while len(self.evals.get(step, {})) < len(ids):
            self._check_reader()
            if time.monotonic() > deadline:
                raise TimeoutError(f"held-out evaluation at step {step} timed out")
            await asyncio.sleep(0.1)
        groups = self.evals.pop(step)
        members = [t for g in groups.values() for t in g.trajectories]
        scores = [task_score(t) for t in members]
        want = (str(step),)
        versions = sorted({v for t in members for tr in t.traces for v in tr.weight_versions})
        rec = {
            "type": "eval",
            "step": step,
            "time": time.time(),
            "elapsed_s": time.time() - self.started,
            "accuracy": statistics.fmean(scores) if scores else 0.0,
            "tasks": len(ids),
            "members": len(members),
            "errored": sum(1 for t in members if not usable(t)),
            "versions": versions,
            "off_version_traces": sum(
                1
                for t in members
                for tr in trainable_traces(t)
                if tuple(tr.weight_versions) != want
            ),
            "eval_s": time.perf_counter() - t0,
        }
        # the step evaluated is the checkpoint just written (or resumed from)
        best = self.cfg.keep_best and self.ckpt.name == ck.step_name(step)
        if best and ck.improves(self.state, rec["accuracy"]):
            self.state.best_step, self.state.best_accuracy = step, rec["accuracy"]
            rec["best"] = True
        self.state.evals_done.append(step)
        self.state.records = [*self.state.records, rec]
        self._write_state()
        if rec.get("best"):
            ck.promote_best(self.root, self.state, self.cfg.keep_checkpoints)
        self.hold += list(groups.values())
        if self._final():  # no later step commits them
            await self._commit([])
        self._emit(rec)
        return rec

    # -- the run ----------------------------------------------------------------------
    def _final(self) -> bool:
        """No step follows: ``steps`` are done, or ``max_seconds`` have passed."""
        limit = self.cfg.max_seconds
        out_of_time = limit is not None and time.time() - self.started >= limit
        return self.state.step >= self.cfg.steps or out_of_time

    async def run(self) -> ck.TrainerState:
        await asyncio.to_thread(self._open_policy)
        await self._connect()
        try:
            if self.resumed:
                self._emit_resume()
            else:
                self.ckpt = await asyncio.to_thread(
                    ck.commit_checkpoint, self.root, self.state, self.policy.save
                )
            await self._sync()  # the engines serve exactly the weights held here
            await self._top_up(0)
            if eval_due(self.cfg, self.state.step) and self.state.step not in self.state.evals_done:
                await self._evaluate(self.state.step)
            while not self._final():
                await self._step()
                if eval_due(self.cfg, self.state.step) or (self._final() and self.cfg.eval.at_end):
                    await self._evaluate(self.state.step)
            self._write_state()
            await asyncio.to_thread(
                metrics.plot, ck.read_log(self.cfg.log_file), self.cfg.plot_file
            )
            # the run's end, in its log: the dashboard's Training page says "done" for a
            # foreground `polar train` too (a served trainer's /healthz says it as well)
            metrics.append_log(self.cfg.log_file, [{"type": "done", "step": self.state.step}])
            self.done = True
            return self.state
        except MismatchError as exc:
            self.error = str(exc)
            metrics.append_log(self.cfg.log_file, [{"type": "error", "error": self.error}])
            raise
        finally:
            await self._close()


async def run_training(cfg: TrainerConfig, on_record: OnRecord | None = None) -> ck.TrainerState:
    return await Trainer(cfg, on_record).run()
