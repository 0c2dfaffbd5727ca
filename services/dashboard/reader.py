"""The dashboard's I/O: what it reads from NATS, Redis and the object store.

It writes nothing there: the bus connection declares no stream, and the one command it
sends is the CLI's cancel (``services/cli/submit.py``'s ``BusTasks.cancel``). Reading a
session's model calls takes an ephemeral consumer, as the builder's reader does.

Connections come from the services' own factories (``Bus.open``, ``Registry.from_url``)
and are made in the background: a stack with NATS or Redis down still gets its pages,
with a banner saying what is unreachable (``problems``), and catches up once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
import redis.exceptions
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError, ObjectNotFoundError

from infra.stackstate import read_state
from schemas import (
    Artifacts,
    CompletionRecord,
    ContractError,
    Grade,
    Outcome,
    Session,
    SessionFinished,
    SessionStateChanged,
    TaskRequest,
    Trajectory,
    decode,
)
from schemas import subjects as S
from services.cli.context import registered_trainer
from services.cli.status import node_rows, stream_rows
from services.common.bus import Bus, CredentialsRefused
from services.common.completions import read_completions
from services.common.redact import Scrubber, known_secrets, redact
from services.common.registry import Registry, TaskRecord
from services.common.tasks import cancel_and_wait
from services.common.tokenization.lru import SizedLRU
from services.dashboard.config import DashboardConfig
from services.dashboard.delivered import Delivered
from services.dashboard.index import ENDED, FAILED, SessionIndex, SessionRow, last_lines, plain
from services.dashboard.views import divergence
from services.pool.backpressure import queue_length

log = logging.getLogger(__name__)
T = TypeVar("T")
REDIS_ERRORS = (redis.exceptions.RedisError, OSError)
TASK_BATCH = 500  # task records read per pipeline at start
REDIS_CLIENT_NAME = "polar-dashboard"
MODEL = "model"  # the embedded engine's service in a stack record (infra/catalog.py)


class StackReader:
    def __init__(self, cfg: DashboardConfig) -> None:
        self.cfg = cfg
        self.index = SessionIndex()
        self.bus: Bus | None = None
        # named, so the server tells its commands apart (tests/integration/test_dashboard_readonly.py)
        self.registry = Registry.from_url(cfg.redis_url, client_name=REDIS_CLIENT_NAME)
        self.redis_error: str | None = "not connected yet"
        self.nats_error: str | None = "not connected yet"
        # apart from nats_error, which each stack poll sets afresh: a stream that is missing
        # stays in the banner until the dashboard follows it, not only between two polls
        self.events_error: str | None = None
        self.loaded = False  # the registry has been read once
        self.specs: dict[str, TaskRequest] = {}
        # a recorded session's replays and forks (their task ids), and its re-grades
        # (``polar regrade``: the re-grade's own grade, the last of each trajectory's)
        self.replays_of: dict[str, list[str]] = {}
        self.regrades: dict[str, dict[str, Grade]] = {}
        self.divergences: dict[str, str | None] = {}  # ended replays' (``divergence``)
        # each session's token: never shown, scrubbed from what is (``secrets``)
        self.tokens: dict[str, str] = {}
        self.artifacts: SizedLRU[str, Any] = SizedLRU(cfg.artifact_sessions, lambda k, v: 1)
        self.trajectories: SizedLRU[tuple[str, int], Trajectory] = SizedLRU(
            cfg.trajectory_cache, lambda k, v: 1
        )
        self._delivered = Delivered()
        self.scored: SizedLRU[tuple[str, int], Trajectory] = SizedLRU(
            cfg.trajectory_cache, lambda k, v: 1
        )
        self.nodes: list[Any] | None = None
        self.streams: list[Any] | None = None
        self.engines: list[dict[str, Any]] = []
        self.backpressure: bool | None = None
        self.trainer: dict[str, Any] | None = None  # the trainer service's run check
        self._dirty: set[str] = set()
        self._new_tasks: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self._subs: list[Any] = []
        self._http = httpx.AsyncClient(timeout=1.0, trust_env=False)

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        self._spawn(self._connect_bus(), "connect-bus")
        self._spawn(self._loop(self.cfg.refresh_seconds, self.refresh), "refresh")
        self._spawn(self._loop(self.cfg.stack_poll_seconds, self.poll_stack), "poll-stack")

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        await self._http.aclose()
        with contextlib.suppress(Exception):
            await self.registry.close()
        if self.bus is not None:
            with contextlib.suppress(Exception):
                await self.bus.close()

    def _spawn(self, coro, name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))

    async def _loop(self, seconds: float, job) -> None:
        while True:
            try:
                await job()
            except Exception:  # noqa: BLE001 - a periodic read must keep going
                log.exception("dashboard: %s failed", job.__name__)
            await asyncio.sleep(seconds)

    async def _connect_bus(self) -> None:
        while self.bus is None:
            try:
                # no declare: the dashboard creates no stream; reconnects forever once up
                self.bus = await Bus.open(self.cfg.nats_url, "polar-dashboard", declare=False)
            except (ConnectionError, OSError) as exc:
                self.nats_error = f"cannot reach NATS at {redact(self.cfg.nats_url)}: {exc}"
                await asyncio.sleep(1.0)
            except CredentialsRefused as exc:  # the stack's credentials changed: say so
                self.nats_error = str(exc)
                await asyncio.sleep(5.0)
        self.nats_error = None
        nc = self.bus.nc
        self._subs.append(await nc.subscribe(S.SESSIONS_FINISHED, cb=self._on_finished))
        await self._follow_events()
        self._spawn(self._follow_regrades(), "follow-regrades")

    async def _follow_events(self) -> None:
        """Every session event from the start of the events stream (the timelines of
        sessions that began before the dashboard did), then live ones."""

        def missing(exc: Exception) -> None:
            self.events_error = f"NATS: no session events stream yet ({exc})"

        await self._follow(S.SESSION_EVENTS, self._on_event, missing, 1.0)
        self.events_error = None

    async def _follow_regrades(self) -> None:
        """Every re-grade stored (``polar regrade``), then live ones: a session's page
        lists them. A stack from before re-grades has no stream: looked for again."""
        await self._follow(S.ALL_REGRADES, self._on_regrade, lambda _exc: None, 5.0)

    async def _follow(self, subject: str, cb, missing, retry_seconds: float) -> None:
        """A stream's messages on ``subject`` from its first on, to ``cb``; until the
        stream exists, ``missing(exc)`` and a retry every ``retry_seconds``."""
        assert self.bus is not None
        while True:
            try:
                sub = await self.bus.js.subscribe(
                    subject, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL, cb=cb
                )
                self._subs.append(sub)
                return
            except Exception as exc:  # noqa: BLE001 - no stream yet
                missing(exc)
                await asyncio.sleep(retry_seconds)

    def _note_spec(self, task_id: str, spec: TaskRequest) -> None:
        self.specs[task_id] = spec
        if spec.replay is not None:
            replays = self.replays_of.setdefault(spec.replay.session_id, [])
            if task_id not in replays:
                replays.append(task_id)

    def lineage(self, session_id: str) -> dict[str, list[dict[str, Any]]]:
        """The session's replays and forks (each its state and reward) and re-grades."""
        replays = []
        for task_id in self.replays_of.get(session_id, []):
            spec = self.specs[task_id]
            for sid in self.index.tasks.get(task_id, []):
                row = self.index.rows.get(sid)
                until = spec.replay.until if spec.replay else None
                replays.append({
                    "session_id": sid,
                    "kind": "replay" if until is None else f"fork after {until} call(s)",
                    "state": row.state if row else None,
                    "reward": row.reward if row else None,
                    "evaluator": spec.evaluator.name,
                })  # fmt: skip
        regrades = [
            msgspec.to_builtins(g) for _, g in sorted(self.regrades.get(session_id, {}).items())
        ]
        return {"replays": replays, "regrades": regrades}

    async def divergence(self, replay_session: str) -> str | None:
        """Where a replay diverged (``views.divergence``), read from its records; kept
        once the replay has ended (its records no longer change), so a session page
        polled live does not read its replays' records again each time."""
        if replay_session in self.divergences:
            return self.divergences[replay_session]
        records, _ = await self.completions(replay_session)
        found = divergence(records)
        row = self.index.rows.get(replay_session)
        if row is not None and row.state in ENDED:
            self.divergences[replay_session] = found
        return found

    # -- what arrives -----------------------------------------------------------------
    async def _on_regrade(self, msg) -> None:
        try:
            t = decode(await self.bus.payload(msg), Trajectory)
        except (ContractError, LookupError):
            return
        if t.grades and t.grades[-1].regrade_id:
            grade = t.grades[-1]
            self.regrades.setdefault(t.session_id, {})[grade.regrade_id] = grade
            self.index.version += 1  # the session's page shows it

    async def _on_event(self, msg) -> None:
        try:
            ev = decode(msg.data, SessionStateChanged)
        except ContractError:
            return
        if ev.task_id not in self.index.tasks:
            self._new_tasks.add(ev.task_id)
        if self.index.apply(ev) and ev.reason:
            self._scrub_reasons(ev.session_id)
        self._dirty.add(ev.session_id)

    async def _on_finished(self, msg) -> None:
        """A finished session's artifacts (diff, logs, tails) are only on the bus, on
        their way to the builder: kept here for the session page."""
        assert self.bus is not None
        try:
            ev = decode(await self.bus.payload(msg), SessionFinished)
        except (ContractError, LookupError):
            return
        self.artifacts.put(ev.session_id, ev.artifacts)
        self._note_run(ev.session_id)

    def _note_run(self, session_id: str) -> None:
        """The run's exit code and, for a run that did not complete, the end of its
        stderr on its row (the lists show them beside its reason), scrubbed as its
        reasons are."""
        art = self.artifacts.get(session_id)
        row = self.index.rows.get(session_id)
        if art is None or row is None:
            return
        failed = row.state in FAILED or row.outcome not in (None, Outcome.COMPLETED.value)
        end = last_lines(plain(art.stderr_tail)) if failed else ""
        if end:
            end = self.secrets(row.task_id, [session_id]).text(end)
        self.index.note_run(session_id, art.exit_code, end or None)

    # -- Redis ------------------------------------------------------------------------
    async def _redis(self, coro):
        try:
            out = await coro
        except REDIS_ERRORS as exc:
            self.redis_error = f"cannot reach Redis at {redact(self.cfg.redis_url)}: {exc}"
            raise
        self.redis_error = None
        return out

    async def load(self) -> None:
        """Every task and session in the registry, once (then the events keep it)."""
        keys = await self.registry.task_ids()
        for i in range(0, len(keys), TASK_BATCH):
            await self._read_tasks(keys[i : i + TASK_BATCH])
        self.loaded = True

    async def _read_tasks(self, task_ids: list[str]) -> None:
        reg = self.registry
        async with reg.redis.pipeline(transaction=False) as p:
            for t in task_ids:
                p.hget(S.key_task(t), "spec")
                p.hget(S.key_task(t), "submitted_at")
                p.lrange(S.key_task_sessions(t), 0, -1)
            raw = await p.execute()
        ids: list[str] = []
        for i, t in enumerate(task_ids):
            spec_raw, submitted, sids = raw[3 * i : 3 * i + 3]
            spec = None
            if spec_raw:
                with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
                    spec = msgspec.json.decode(spec_raw, type=TaskRequest)
            if spec is not None:
                self._note_spec(t, spec)
            self.index.add_task(t, spec.agent.harness if spec else None, float(submitted or 0))
            for row in self.index.task_rows(t):  # rows the events made before we knew
                row.harness = spec.agent.harness if spec else None
            ids += [s.decode() for s in sids]
        for s in await reg.get_sessions(ids):
            if s is not None:
                self._put(s)

    def _put(self, session: Session) -> None:
        self.index.put(session)
        self.tokens[session.session_id] = session.token
        self._scrub_reasons(session.session_id)
        self._note_run(session.session_id)  # artifacts that came before the row

    def _scrub_reasons(self, session_id: str) -> None:
        """A row's reasons as every list shows them (sessions table, errors by reason):
        without the session's token or its task's env values (the executor scrubs the
        reasons it writes; an evaluator's may quote what the harness left)."""
        row = self.index.rows.get(session_id)
        if row is None or not (row.reason or row.eval_reason):
            return
        scrub = self.secrets(row.task_id, [session_id])
        row.reason = scrub.text(plain(row.reason)) if row.reason else row.reason
        row.eval_reason = scrub.text(plain(row.eval_reason)) if row.eval_reason else None

    def secrets(self, task_id: str, session_ids: Iterable[str] = ()) -> Scrubber:
        """What a page about this task (and these of its sessions) must not show: their
        tokens and the task's env values, as the executor scrubs the harness's output."""
        spec = self.specs.get(task_id)
        known = known_secrets(None, spec)
        for sid in session_ids:
            known += known_secrets(self.tokens.get(sid), None)
        return Scrubber(known)

    async def refresh(self) -> None:
        """Re-read what the events said changed: a reward, reasons, the node."""
        try:
            if not self.loaded:
                await self._redis(self.load())
            if self._new_tasks:
                new, self._new_tasks = list(self._new_tasks), set()
                await self._redis(self._read_tasks(new))
            if self._dirty:
                dirty, self._dirty = list(self._dirty), set()
                for s in await self._redis(self.registry.get_sessions(dirty)):
                    if s is not None:
                        self._put(s)
        except REDIS_ERRORS:
            return

    async def poll_stack(self) -> None:
        try:
            raw = await self._redis(self.registry.redis.hgetall(S.KEY_NODES))
            self.nodes = node_rows(raw, time.time())
            self.backpressure = bool(
                await self._redis(self.registry.redis.exists(S.KEY_BACKPRESSURE))
            )
        except REDIS_ERRORS:
            self.nodes, self.backpressure = None, None
        if self.bus is not None and self.bus.nc.is_connected:
            try:
                self.streams = await stream_rows(self.bus.js)
                self.nats_error = None
            except Exception as exc:  # noqa: BLE001 - the banner says it
                self.streams = None
                self.nats_error = f"NATS JetStream: {exc or type(exc).__name__}"
        elif self.bus is not None:
            self.streams = None
            self.nats_error = f"NATS at {redact(self.cfg.nats_url)} is not connected (reconnecting)"
        self.engines = await asyncio.gather(*(self._engine(b) for b in self.backends()))
        if self.trainer_log_path():
            self.trainer = await self.trainer_run()

    def backends(self) -> list[dict[str, Any]]:
        """The engines to watch: the topology's backends; with none listed, the stack's
        embedded ``model`` service, which then serves (the proxy's default backend,
        ``infra/wiring.py``), as its stack record names it."""
        if self.cfg.backends:
            return self.cfg.backends
        record = self.stack_record()
        procs = record.procs if record is not None else []
        return [
            {"name": p.name, "kind": "embedded", "url": p.url} for p in procs if p.name == MODEL
        ]

    async def _engine(self, backend: dict[str, Any]) -> dict[str, Any]:
        url = backend.get("url")
        row = {"name": backend.get("name", "default"), "kind": backend.get("kind"), "url": url}
        if not url:
            return {**row, "queue": None, "up": None}
        try:
            r = await self._http.get(f"{url.rstrip('/')}/metrics")
        except httpx.HTTPError:
            return {**row, "queue": None, "up": False}
        return {**row, "queue": queue_length(r.text) if r.is_success else None, "up": True}

    def problems(self) -> list[str]:
        return [p for p in (self.nats_error, self.events_error, self.redis_error) if p]

    # -- one task, one session ---------------------------------------------------------
    async def task(self, task_id: str) -> TaskRecord | None:
        try:
            record = await self._redis(self.registry.get_task(task_id))
        except REDIS_ERRORS:
            return None
        if record is not None:
            self._note_spec(task_id, record.spec)
        return record

    async def completions(self, session_id: str) -> tuple[list[CompletionRecord], list[str]]:
        if self.bus is None or not self.bus.nc.is_connected:
            return [], ["NATS is unreachable: model calls cannot be read"]
        try:
            return await read_completions(self.bus, session_id, timeout=3.0)
        except (TimeoutError, NotFoundError) as exc:
            return [], [f"reading model calls: {exc}"]

    async def trajectory(self, session_id: str, attempt: int, final: bool) -> Trajectory | None:
        """The built trajectory in the object store (cached once the session ended)."""
        key = (session_id, attempt)
        if (hit := self.trajectories.get(key)) is not None:
            return hit
        traj = await self._stored(S.trajectory_object(session_id, attempt), Trajectory)
        if final and traj is not None:
            self.trajectories.put(key, traj)
        return traj

    async def _stored(self, name: str, kind: type[T]) -> T | None:
        """An object-store entry decoded; None when absent, unreadable or NATS is away
        (shown as "not built" / "no artifacts")."""
        if self.bus is None or not self.bus.nc.is_connected:
            return None
        try:
            return decode((await (await self.bus.blobs()).get(name)).data, kind)
        except (ObjectNotFoundError, NotFoundError, ContractError):
            return None
        except Exception:  # noqa: BLE001 - a read that fails shows as missing
            log.warning("object %s unreadable", name, exc_info=True)
            return None

    async def run_artifacts(self, session_id: str, attempt: int) -> Artifacts | None:
        """A finished run's artifacts: as the bus carried them, else (a restarted
        dashboard, an evicted entry) the copy the builder stored beside its trajectory."""
        if (hit := self.artifacts.get(session_id)) is not None:
            return hit
        art = await self._stored(S.artifacts_object(session_id, attempt), Artifacts)
        if art is None:
            return None
        self.artifacts.put(session_id, art)
        self._note_run(session_id)
        return art

    async def delivered(self, row: SessionRow) -> Trajectory | None:
        """The scored trajectory trainers got for the row's attempt (its reward on it and
        its traces; the object store's copy has none): None before it was delivered."""
        if row.state not in ENDED or not row.synced:
            return None
        if self.bus is None or not self.bus.nc.is_connected:
            return None
        key = (row.session_id, row.attempt)
        if (hit := self.scored.get(key)) is not None:
            return hit
        try:
            traj = await self._delivered.get(
                self.bus, row.task_id, row.session_id, row.attempt, row.updated_at
            )
        except Exception:  # noqa: BLE001 - a read that fails shows the built one
            log.warning("delivered trajectory of %s unreadable", row.session_id, exc_info=True)
            return None
        if traj is not None:
            self.scored.put(key, traj)
        return traj

    async def cancel(self, task_id: str, reason: str) -> str:
        """The CLI's own cancel command, on the dashboard's connection."""
        from services.cli.submit import BusTasks

        if self.bus is None or not self.bus.nc.is_connected:
            raise ConnectionError("NATS is unreachable: cannot send the cancel")
        return await BusTasks(self.bus, self.cfg.redis_url).cancel(task_id, reason)

    # -- files ------------------------------------------------------------------------
    def stack_record(self) -> Any:
        if not self.cfg.state_dir:
            return None
        try:
            return read_state(Path(self.cfg.state_dir))
        except RuntimeError:
            return None

    def trainer_log_path(self) -> str | None:
        """The training page's log: the stack's trainer service's (``polar up`` names it),
        else the one a foreground ``polar train`` registered with the stack's state dir."""
        if self.cfg.trainer_log:
            return self.cfg.trainer_log
        registered = registered_trainer(self.cfg.state_dir)
        return registered.log_path if registered is not None else None

    def trainer_log(self) -> list[bytes] | None:
        path = self.trainer_log_path()
        if not path:
            return None
        try:
            return Path(path).read_bytes().splitlines()
        except OSError:
            return []

    async def trainer_run(self) -> dict[str, Any] | None:
        """The stack's trainer service's word on its run (its ``/healthz`` ``run``
        check: done, error); None when the stack runs none or it does not answer."""
        record = self.stack_record()
        proc = record.get("trainer") if record is not None else None
        if proc is None:
            return None
        try:
            r = await self._http.get(f"{proc.url.rstrip('/')}/healthz")
            run = r.json().get("checks", {}).get("run")
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return run if isinstance(run, dict) else None

    def trainer_log_stamp(self) -> list[Any] | None:
        """The trainer log's (size, mtime) and the trainer service's run state: they
        change as each step is logged and as the run ends, so the live stream tells the
        training page to re-read; None: no log (yet)."""
        path = self.trainer_log_path()
        if not path:
            return None
        try:
            st = Path(path).stat()
        except OSError:
            return None
        run = self.trainer or {}
        return [st.st_size, st.st_mtime_ns, bool(run.get("done")), run.get("error")]

    @functools.cached_property
    def decoder(self):
        """One token id -> its text, with the stack's tokenizer; None without one."""
        if not self.cfg.model_dir:
            return None
        from services.common.tokenization.tokenizer import ChatTokenizer, TokenizerLoadError

        try:
            tok = ChatTokenizer.load(self.cfg.model_dir)
        except (TokenizerLoadError, OSError):
            log.warning("no tokenizer in %s: token ids shown undecoded", self.cfg.model_dir)
            return None
        return functools.lru_cache(maxsize=65536)(tok.token_text)
