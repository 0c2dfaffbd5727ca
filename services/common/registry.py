"""The Redis session registry.

Every state change goes through one compare-and-set Lua script (``transition.lua``);
each successful change is then published as a ``SessionStateChanged`` event on
``polar.events.session.<state>`` with the dedupe id ``<session>:<version>``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from importlib import resources

import msgspec
import redis.asyncio as aioredis

from schemas import (
    ALLOWED_FROM,
    Session,
    SessionState,
    SessionStateChanged,
    TaskRequest,
    encode,
    session_id_for,
)
from schemas import subjects as S
from services.common.endpoints import redis_client
from services.common.faults import BUS_DOWN, REGISTRY_DOWN
from services.common.metrics import TRANSITIONS
from services.common.redact import redact

Publisher = Callable[[str, bytes, str], Awaitable[object]]  # (subject, payload, msg_id)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outgoing:
    """A message that must follow a registry change (see ``Registry.transition``)."""

    subject: str
    payload: bytes
    msg_id: str  # the bus's dedupe id: a second copy of it is dropped


# Remove a lease only if it is still expired (a holder may have just renewed it).
_TAKE_EXPIRED = """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if s and tonumber(s) <= tonumber(ARGV[2]) then return redis.call('ZREM', KEYS[1], ARGV[1]) end
return 0
"""

# Renew leases (KEYS[1]) on the sessions ARGV[3..] that ARGV[1] still holds, to expiry
# ARGV[2]; returns those it no longer holds (retried meanwhile: another's, or nobody's).
_HOLD = """
local lost = {}
for i = 3, #ARGV do
  if redis.call('HGET', @key_session('')@ .. ARGV[i], 'lease_owner') == ARGV[1] then
    redis.call('ZADD', KEYS[1], ARGV[2], ARGV[i])
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""

# Remove a lease only if its owner is still the one named (a new holder may have it)
# and, with ARGV[2], the session is still at that attempt (one holder may come to hold
# the next attempt too: a pool back from a cut admitting it while the old INIT unwinds).
_RELEASE_OWN = """
local cur = redis.call('HMGET', KEYS[2], 'lease_owner', 'attempt')
if cur[1] == ARGV[1] and (ARGV[2] == '' or (cur[2] or '0') == ARGV[2]) then
  return redis.call('ZREM', KEYS[1], string.sub(KEYS[2], string.len(@key_session('')@) + 1))
end
return 0
"""

# The sizes of sets (KEYS[2..]) and whether KEYS[1] exists, read in one atomic step: a
# node's stage counts as one snapshot (a session moving between two of them is counted
# once), with the backpressure flag that gates admission beside them.
_COUNT_SETS = """
local out = {}
for i = 2, #KEYS do out[i - 1] = redis.call('SCARD', KEYS[i]) end
out[#KEYS] = redis.call('EXISTS', KEYS[1])
return out
"""

# A task's fields ARGV (KEYS[1]) and its per-state counts (KEYS[2]), in one step: what the
# scheduler reads on every terminal event.
_TASK_AND_COUNTS = """
return {redis.call('HMGET', KEYS[1], unpack(ARGV)), redis.call('HGETALL', KEYS[2])}
"""

REDACTED_FIELDS = ("reason", "eval_reason")
SPEC_CACHE_SIZE = 4096  # task specs kept per process (a few kB each)

# The proxy's per-call session lookup, one round trip (sent through the proxy's own RESP
# client, proxy/capture.py): the token (KEYS[1]) -> the fields of its session a call
# needs, and for the caller's own keys, whose prefixes it names: the first ARGV[2] + 1
# items of the list ARGV[1] .. sid .. ':' .. attempt, and, when ARGV[3] is '1' and the
# session is RUNNING, INCR ARGV[4] .. sid (the number taken: the count before it, else
# -1). Reply: false for an unknown token, else {{session_id, attempt, state, task_id,
# replay}, list, number} (a field the hash lacks: '', attempt '0'; replay: the task's
# ReplaySpec json, written only for a replay's sessions). Five fields, not the whole
# hash: every model call reads them, and turning all of it into a Session took ~4% of
# the proxy's request handling (py-spy, chat mode, 64 sessions).
SESSION_FOR_CALL = (
    "local sid = redis.call('GET', KEYS[1]) "
    "if not sid then return false end "
    f"local key = '{S.key_session('')}' .. sid "
    "local f = redis.call('HMGET', key, 'attempt', 'state', 'task_id', 'replay') "
    "local attempt = f[1] or '0' "
    "local items = redis.call('LRANGE', ARGV[1] .. sid .. ':' .. attempt, 0, ARGV[2]) "
    "local seq = -1 "
    "if ARGV[3] == '1' and f[2] == 'RUNNING' then "
    "seq = redis.call('INCR', ARGV[4] .. sid) - 1 end "
    "return {{sid, attempt, f[2] or '', f[3] or '', f[4] or ''}, items, seq}"
)


# ``@key_name(lua, exprs)@`` or ``@KEY_NAME@`` in a script: a key named in
# schemas/subjects.py, so the scripts hold no copies of the key layouts.
_KEY_MACRO = re.compile(r"@(\w+)(?:\(([^)@]*)\))?@")
_ARG_MARK = re.compile("\x00([0-9]+)\x00")


def _lua_literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def expand_keys(lua: str) -> str:
    """``lua`` with each key macro written as the Lua expression that builds that key:
    the subjects function is called with markers in place of its arguments, and the
    text around the markers becomes Lua literals joined to the argument expressions."""

    def expand(match: re.Match[str]) -> str:
        named = getattr(S, match.group(1))
        if match.group(2) is None:
            return _lua_literal(named)
        args = [arg.strip() for arg in match.group(2).split(",")]
        pieces = _ARG_MARK.split(named(*(f"\x00{i}\x00" for i in range(len(args)))))
        lua_parts = []  # split() alternates literal text and marker numbers
        for i, piece in enumerate(pieces):
            if i % 2:
                lua_parts.append(args[int(piece)])
            elif piece:
                lua_parts.append(_lua_literal(piece))
        return "(" + " .. ".join(lua_parts) + ")"

    return _KEY_MACRO.sub(expand, lua)


def _script(name: str) -> str:
    return expand_keys(resources.files(__package__).joinpath(name).read_text())


def new_token() -> str:
    """An unguessable session token (256 bits), safe in URLs and HTTP headers."""
    return "ps_" + secrets.token_urlsafe(32)


def spec_digest(spec: bytes) -> str:
    return hashlib.sha256(spec).hexdigest()


@dataclass(frozen=True)
class Transition:
    ok: bool
    session_id: str
    from_state: SessionState | None  # the state before (or the current one, on failure)
    version: int
    exists: bool = True


@dataclass(frozen=True)
class TaskRecord:
    task_id: str
    spec: TaskRequest
    status: str
    submitted_at: float
    result: bytes | None


class Registry:
    def __init__(self, redis: aioredis.Redis, publish: Publisher | None = None) -> None:
        self.redis = redis
        self.publish = publish
        self._transition = redis.register_script(_script("transition.lua"))
        self._create = redis.register_script(_script("create_task.lua"))
        self._take_expired = redis.register_script(_TAKE_EXPIRED)
        self._release_own = redis.register_script(expand_keys(_RELEASE_OWN))
        self._hold = redis.register_script(expand_keys(_HOLD))
        self._count_sets = redis.register_script(_COUNT_SETS)
        self._task_and_counts = redis.register_script(_TASK_AND_COUNTS)
        # A task's spec never changes once registered (create_task.lua refuses another
        # spec under the same id), and every service stops when the registry loses its
        # state (host.py's epoch watch): so specs are cached, not read per session.
        self._specs: OrderedDict[str, TaskRequest] = OrderedDict()

    @classmethod
    def from_url(
        cls, url: str, publish: Publisher | None = None, *, client_name: str | None = None
    ) -> Registry:
        """``client_name``: what ``CLIENT LIST`` calls its connections (who sent what)."""
        return cls(redis_client(url, client_name=client_name), publish)

    async def close(self) -> None:
        await self.redis.aclose()

    # -- epoch: did the registry lose its state? ---------------------------------------
    async def ensure_epoch(self) -> str:
        """The registry's epoch marker, written now if this is a fresh registry (the
        first writer wins: services starting together all read the same one)."""
        await self.redis.set(S.KEY_REGISTRY_EPOCH, secrets.token_hex(8), nx=True)
        epoch = await self.redis.get(S.KEY_REGISTRY_EPOCH)
        return epoch.decode() if epoch else await self.ensure_epoch()

    async def epoch(self) -> str | None:
        """The epoch marker now (None: gone — the registry lost everything)."""
        epoch = await self.redis.get(S.KEY_REGISTRY_EPOCH)
        return epoch.decode() if epoch else None

    # -- tasks ----------------------------------------------------------------------
    async def create_task(
        self, task: TaskRequest, now: float | None = None
    ) -> tuple[int, list[Session]]:
        """Register ``task`` and its sessions. Returns (1 created | 0 duplicate | -1 conflict, sessions)."""
        assert task.task_id, "the scheduler assigns task ids before registering"
        now = time.time() if now is None else now
        spec = encode(task)
        sessions = [
            Session(
                session_id=session_id_for(task.task_id, i),
                task_id=task.task_id,
                index=i,
                token=new_token(),
                priority=task.priority,
                created_at=now,
                deadline=now + task.timeout_seconds,
            )
            for i in range(task.num_samples)
        ]
        args: list[object] = [task.task_id, spec, spec_digest(spec), now, len(sessions)]
        for s in sessions:
            args += [s.session_id, s.token, s.index, s.priority, s.deadline]
        args.append(encode(task.replay) if task.replay is not None else "")
        keys = [
            S.key_task(task.task_id),
            S.key_task_sessions(task.task_id),
            S.key_task_counts(task.task_id),
            S.KEY_STATE_COUNTS,
            S.KEY_TASKS_ACTIVE,
        ]
        created = int(await self._create(keys=keys, args=args))
        if created != 1:  # the registered sessions are the truth (their tokens differ)
            sessions = await self.task_sessions(task.task_id)
        return created, sessions

    async def get_task(self, task_id: str) -> TaskRecord | None:
        spec, fields = self._task_fields(task_id)
        return self._task_record(task_id, spec, await self.redis.hmget(S.key_task(task_id), fields))

    async def task_and_counts(self, task_id: str) -> tuple[TaskRecord | None, dict[str, int]]:
        """``get_task`` and ``task_counts`` in one round trip (one atomic read)."""
        spec, fields = self._task_fields(task_id)
        keys = [S.key_task(task_id), S.key_task_counts(task_id)]
        raw, counts = await self._task_and_counts(keys=keys, args=fields)
        pairs = zip(counts[::2], counts[1::2], strict=True)  # a flat HGETALL reply
        return self._task_record(task_id, spec, raw), _nonzero(pairs)

    def _task_fields(self, task_id: str) -> tuple[TaskRequest | None, tuple[str, ...]]:
        spec = self._cached_spec(task_id)
        if spec is None:  # also read the spec (and cache it)
            return None, ("status", "submitted_at", "result", "spec")
        return spec, ("status", "submitted_at", "result")

    def _task_record(self, task_id: str, spec: TaskRequest | None, raw: list) -> TaskRecord | None:
        if raw[0] is None:  # ``status`` is set with the task: no task
            return None
        if spec is None:
            spec = self._cache_spec(task_id, raw[3])
        return TaskRecord(
            task_id=task_id,
            spec=spec,
            status=raw[0].decode(),
            submitted_at=float(raw[1] or 0),
            result=raw[2],
        )

    def _cache_spec(self, task_id: str, raw: bytes) -> TaskRequest:
        spec = self._specs[task_id] = msgspec.json.decode(raw, type=TaskRequest)
        if len(self._specs) > SPEC_CACHE_SIZE:
            self._specs.popitem(last=False)
        return spec

    def _cached_spec(self, task_id: str) -> TaskRequest | None:
        spec = self._specs.get(task_id)
        if spec is not None:
            self._specs.move_to_end(task_id)  # least recently used goes first
        return spec

    async def task_spec(self, task_id: str) -> TaskRequest | None:
        """The task's spec (None: not registered), read from Redis once per process."""
        if (spec := self._cached_spec(task_id)) is not None:
            return spec
        raw = await self.redis.hget(S.key_task(task_id), "spec")
        return None if raw is None else self._cache_spec(task_id, raw)

    async def finish_task(self, task_id: str, status: str, result: bytes) -> bytes:
        """Store the task's result once; returns the stored one (the first writer wins)."""
        key = S.key_task(task_id)
        if await self.redis.hsetnx(key, "result", result):
            await self.redis.hset(key, "status", status)
            return result
        return await self.redis.hget(key, "result")

    async def callback_status(self, task_id: str) -> str | None:
        """The task's result callback: ``done``, ``failed``, or None (not delivered yet)."""
        raw = await self.redis.hget(S.key_task(task_id), "callback")
        return raw.decode() if raw else None

    async def set_callback_status(self, task_id: str, status: str) -> None:
        await self.redis.hset(S.key_task(task_id), "callback", status)

    async def task_ids(self) -> list[str]:
        """Every task in the registry, finished or not (a scan: for readers, not loops)."""
        ids = []
        async for key in self.redis.scan_iter(match=S.key_task("*"), count=1000):
            task_id = key.decode().removeprefix(S.key_task(""))
            if ":" not in task_id:  # the task's hash, not its :sessions / :counts
                ids.append(task_id)
        return ids

    async def runtime_id(self, session_id: str) -> str | None:
        """The runtime the pool prepared for the session (set as it became READY)."""
        raw = await self.redis.hget(S.key_session(session_id), "runtime_id")
        return raw.decode() if raw else None

    async def retire_task(self, task_id: str, keep_seconds: float = 0.0) -> list[str]:
        """Nothing more to do for the task: stop reconciling it; with ``keep_seconds``
        (the retention policy) its keys and its sessions' expire that long from now.
        Returns its session ids (their other owners' keys expire with them)."""
        ids = await self.task_session_ids(task_id)
        if keep_seconds > 0:
            keys = [S.key_task(task_id), S.key_task_sessions(task_id), S.key_task_counts(task_id)]
            await expire(self.redis, [*keys, *map(S.key_session, ids)], keep_seconds)
        await self.redis.srem(S.KEY_TASKS_ACTIVE, task_id)
        return ids

    async def claim(self, name: str, owner: str, ttl_seconds: float) -> bool:
        """A short exclusive claim on a one-off job (expires if its owner dies)."""
        return bool(
            await self.redis.set(S.key_claim(name), owner, nx=True, px=int(ttl_seconds * 1000))
        )

    async def use_ticket(self, service: str, nonce: str, expiry: int) -> bool:
        """Record a sign-in link's first use (kept until the link expires); False if it
        was used before, by this process, an earlier one or a replica."""
        key = S.key_ticket(service, nonce)
        return bool(await self.redis.set(key, b"1", nx=True, exat=expiry))

    async def active_tasks(self) -> list[str]:
        return sorted(t.decode() for t in await self.redis.smembers(S.KEY_TASKS_ACTIVE))

    async def task_session_ids(self, task_id: str) -> list[str]:
        return [s.decode() for s in await self.redis.lrange(S.key_task_sessions(task_id), 0, -1)]

    async def task_sessions(self, task_id: str) -> list[Session]:
        ids = await self.task_session_ids(task_id)
        return [s for s in await self.get_sessions(ids) if s is not None]

    async def task_counts(self, task_id: str) -> dict[str, int]:
        return _nonzero((await self.redis.hgetall(S.key_task_counts(task_id))).items())

    async def state_counts(self) -> dict[str, int]:
        return _nonzero((await self.redis.hgetall(S.KEY_STATE_COUNTS)).items())

    # -- leases: who holds a session's runtime, until when ------------------------------
    async def hold(self, session_ids: Iterable[str], owner: str, ttl_seconds: float) -> list[str]:
        """Renew the leases ``owner`` holds on sessions (taken with their state change,
        ``transition(lease=...)``; a holder renews well before expiry). Returns the ones
        it no longer holds: a holder cut off past its lease, back after the session was
        retried, must not take the new attempt's lease (its end would then drop it)."""
        ids = list(session_ids)
        if not ids:
            return []
        expiry = repr(time.time() + ttl_seconds)
        lost = await self._hold(keys=[S.KEY_LEASES], args=[owner, expiry, *ids])
        return [sid.decode() for sid in lost]

    async def release(
        self, session_id: str, owner: str | None = None, attempt: int | None = None
    ) -> None:
        """Drop the session's lease; with ``owner``, only while that owner holds it, and
        with ``attempt`` too, only while the session is at that attempt."""
        if owner is None:
            await self.redis.zrem(S.KEY_LEASES, session_id)
        else:
            args = [owner, "" if attempt is None else str(attempt)]
            await self._release_own(keys=[S.KEY_LEASES, S.key_session(session_id)], args=args)

    async def server_uptime(self) -> float:
        """Seconds since the registry's server (re)started."""
        return float((await self.redis.info("server"))["uptime_in_seconds"])

    async def expired_leases(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        return [m.decode() for m in await self.redis.zrangebyscore(S.KEY_LEASES, "-inf", now)]

    async def expire_unleased(self, states: Iterable[SessionState], older_than: float) -> list[str]:
        """Give every session in one of ``states`` that has no lease at all, and has not
        changed for ``older_than`` seconds, an already-expired lease, so a reaper ends or
        retries it like any session whose holder died. Returns those sessions.

        Sessions are found by node (the per-node state sets, nodes from their heartbeats).
        A holder takes its lease with the state change (``transition(lease=...)``), so a
        live session without one is an orphan: a holder died between steps that are not
        one (or a bug)."""
        nodes = sorted({k.decode().split("/", 1)[0] for k in await self.redis.hkeys(S.KEY_NODES)})
        async with self.redis.pipeline(transaction=False) as p:
            for node in nodes:
                for st in states:
                    p.smembers(S.key_node_state(node, st.value))
            members = await p.execute()
        ids = sorted({m.decode() for group in members for m in group})
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as p:
            for sid in ids:
                p.zscore(S.KEY_LEASES, sid)
                p.hget(S.key_session(sid), "updated_at")
            rows = await p.execute()
        cutoff = time.time() - older_than
        orphans = [
            sid
            for sid, score, updated in zip(ids, rows[::2], rows[1::2], strict=True)
            if score is None and updated is not None and float(updated) < cutoff
        ]
        if orphans:  # NX: a holder that took its lease meanwhile keeps it
            await self.redis.zadd(S.KEY_LEASES, {sid: 0 for sid in orphans}, nx=True)
        return orphans

    async def take_expired(self, session_id: str, now: float | None = None) -> bool:
        """Claim an expired lease for cleanup: exactly one reaper gets True."""
        now = time.time() if now is None else now
        return bool(await self._take_expired(keys=[S.KEY_LEASES], args=[session_id, now]))

    # -- sessions -------------------------------------------------------------------
    async def node_stage_counts(self, node: str, states: Iterable[SessionState]) -> dict[str, int]:
        """How many sessions placed on ``node`` are in each of ``states`` right now."""
        return (await self.admission_view(node, states))[0]

    async def admission_view(
        self, node: str, states: Iterable[SessionState]
    ) -> tuple[dict[str, int], bool]:
        """``node_stage_counts`` and whether the engines' backpressure flag is set, in one
        round trip (the pool reads both before each admission)."""
        states = list(states)
        keys = [S.KEY_BACKPRESSURE, *(S.key_node_state(node, st.value) for st in states)]
        *counts, flagged = await self._count_sets(keys=keys)
        return {st.value: int(c) for st, c in zip(states, counts, strict=True)}, bool(flagged)

    async def node_sessions(self, node: str, state: SessionState) -> list[str]:
        return sorted(
            m.decode() for m in await self.redis.smembers(S.key_node_state(node, state.value))
        )

    async def get_session(self, session_id: str) -> Session | None:
        # one command, not a pipeline of one (redis-py's pipeline costs several times a
        # plain command's CPU: the read that every service makes per session)
        row = await self.redis.hgetall(S.key_session(session_id))
        return _session(row) if row else None

    async def get_sessions(self, session_ids: Iterable[str]) -> list[Session | None]:
        ids = list(session_ids)
        async with self.redis.pipeline(transaction=False) as p:
            for sid in ids:
                p.hgetall(S.key_session(sid))
            rows = await p.execute()
        return [_session(row) if row else None for row in rows]

    async def session_by_token(self, token: str) -> Session | None:
        sid = await self.redis.get(S.key_token(token))
        return await self.get_session(sid.decode()) if sid else None

    async def transition(
        self,
        session_id: str,
        to: SessionState,
        *,
        from_: Iterable[SessionState] | None = None,
        expect_version: int | None = None,
        expect_attempt: int | None = None,
        reason: str | None = None,
        lease: tuple[str, float] | None = None,
        release_lease: str | None = None,
        outbox: Outgoing | None = None,
        **fields: object,
    ) -> Transition:
        """Move ``session_id`` to ``to`` if its state is one of ``from_`` (default: any
        state the state machine allows) and, if given, its version is ``expect_version``
        and its attempt ``expect_attempt`` (a holder fences its own attempt with it).
        ``lease`` (owner, ttl seconds): take the session's lease in the same atomic step;
        ``release_lease`` (owner): drop it in that step while that owner holds it (as
        ``release(owner=..., attempt=...)``, the attempt fenced by ``expect_attempt``,
        without a round trip of its own). ``outbox``: the message that must follow the
        change, kept in the registry's outbox in the same step (``services.common.outbox``
        publishes it and marks it sent)."""
        allowed = ALLOWED_FROM[to] if from_ is None else frozenset(from_) & ALLOWED_FROM[to]
        now = time.time()
        if reason is not None:
            fields["reason"] = reason
        if lease is not None:
            fields["lease_owner"] = lease[0]
        for key in REDACTED_FIELDS:  # what people read: no session token, no API key
            if isinstance(fields.get(key), str):
                fields[key] = redact(fields[key])
        args: list[object] = [
            to.value,
            "," + ",".join(sorted(allowed)) + ",",
            "" if expect_version is None else str(expect_version),
            now,
            "" if lease is None else repr(now + lease[1]),
            "" if expect_attempt is None else str(expect_attempt),
            release_lease or "",
            *(("", "", "") if outbox is None else (outbox.msg_id, outbox.subject, outbox.payload)),
        ]
        for k, v in fields.items():
            args += [k, "" if v is None else str(v)]
        code, prev, version, seq, *placed = await self._transition(
            keys=[S.key_session(session_id), S.KEY_STATE_COUNTS, S.KEY_LEASES], args=args
        )
        prev_state = SessionState(prev.decode()) if prev else None
        result = Transition(code == 1, session_id, prev_state, int(version), exists=code != -1)
        TRANSITIONS.labels(to.value, "ok" if result.ok else "conflict").inc()
        if result.ok and self.publish is not None:
            node = placed[0].decode() if placed and placed[0] else None
            await self._emit(session_id, prev_state, to, int(version), int(seq), node, fields, now)
        return result

    async def _emit(self, session_id, prev, to, version, seq, node, fields, now) -> None:
        task_id = session_id.rsplit("-", 1)[0]
        event = SessionStateChanged(
            ts=now,
            session_id=session_id,
            task_id=task_id,
            from_state=prev,
            to_state=to,
            version=version,
            seq=seq,
            node=node,
            reason=_opt_str(fields.get("reason")),
        )
        subject, payload, msg_id = (
            S.session_event(to.value),
            encode(event),
            f"{session_id}:{version}",
        )
        try:
            await self.publish(subject, payload, msg_id)
        except BUS_DOWN as exc:
            # The change is made: the caller's own hand-off must still go (it raised here
            # before, and a retry's INIT work was never queued: issue 33). The event waits
            # in the outbox for the bus instead.
            log.warning("state event %s not published (%r): kept in the outbox", msg_id, exc)
            with contextlib.suppress(*REGISTRY_DOWN):
                await self.outbox_keep(Outgoing(subject, payload, msg_id))

    # -- the outbox (services/common/outbox.py) ---------------------------------------
    async def outbox_keep(self, *outs: Outgoing) -> None:
        """Keep ``outs`` until ``outbox_sent``: for messages whose registry change was
        made without them (``transition(outbox=...)`` keeps one in the change's own step)."""
        now = time.time()
        async with self.redis.pipeline(transaction=True) as p:
            p.hset(
                S.KEY_OUTBOX,
                mapping={o.msg_id: o.subject.encode() + b"\n" + o.payload for o in outs},
            )
            p.zadd(S.KEY_OUTBOX_DUE, {o.msg_id: now for o in outs})
            await p.execute()

    async def outbox_sent(self, *msg_ids: str) -> None:
        async with self.redis.pipeline(transaction=True) as p:
            p.hdel(S.KEY_OUTBOX, *msg_ids)
            p.zrem(S.KEY_OUTBOX_DUE, *msg_ids)
            await p.execute()

    async def outbox_due(self, kept_before: float, limit: int = 500) -> list[Outgoing]:
        """What the outbox has held since before ``kept_before`` (epoch seconds), oldest
        first: the messages whose own publish failed, or whose publisher died."""
        ids = await self.redis.zrangebyscore(S.KEY_OUTBOX_DUE, "-inf", kept_before, 0, limit)
        if not ids:
            return []
        rows = await self.redis.hmget(S.KEY_OUTBOX, ids)
        due = []
        for msg_id, row in zip(ids, rows, strict=True):
            if row is None:  # sent meanwhile
                await self.redis.zrem(S.KEY_OUTBOX_DUE, msg_id)
                continue
            subject, _, payload = row.partition(b"\n")
            due.append(Outgoing(subject.decode(), payload, msg_id.decode()))
        return due

    async def outbox_size(self) -> int:
        return int(await self.redis.zcard(S.KEY_OUTBOX_DUE))


def _nonzero(pairs: Iterable[tuple[bytes, bytes]]) -> dict[str, int]:
    """Per-state counts from a hash's (field, value) pairs, the zeros left out."""
    return {k.decode(): int(v) for k, v in pairs if int(v)}


def _opt_str(v: object) -> str | None:
    return None if v is None else str(v)


def _session(row: dict[bytes, bytes]) -> Session:
    data = {k.decode(): v.decode() for k, v in row.items()}
    return msgspec.convert(data, Session, strict=False)


# PEXPIRE each of KEYS by ARGV[1] ms: one command (a pipeline of one PEXPIRE per key
# cost the scheduler ~0.2 ms of CPU per session in redis-py's packing and parsing).
_EXPIRE_ALL = "for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[1]) end return #KEYS"


async def expire(redis, keys: list[str], seconds: float) -> None:
    """Give ``keys`` a time to live (one round trip)."""
    if keys:
        await redis.eval(_EXPIRE_ALL, len(keys), *keys, max(1, int(seconds * 1000)))
