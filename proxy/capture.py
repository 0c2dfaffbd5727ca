"""Capture: every model call becomes a CompletionRecord in JetStream before the harness
sees its answer. If the record cannot be committed, the harness gets an error instead.

Session state the proxy needs across calls (the call sequence number and the TITO turn
states) lives in Redis, so proxy replicas stay stateless.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import orjson

from proxy.backends.base import Generation
from proxy.callcount import RELEASE_IF_LAST
from proxy.errors import ErrorKind, ProxyError, UpstreamError
from proxy.io.resp import RedisReplyError, RedisUnavailable, Resp, Script
from proxy.tito import MAX_STATES, PromptPlan, TurnState
from schemas import CompletionRecord, Protocol, Timings, UpstreamMode, encode
from schemas import subjects as S
from schemas.completion import ReplayMark, ToolParse, common_prefix_length, delta_at
from schemas.routing import RoutedExperts
from services.common.jspub import JetStreamPublisher
from services.common.registry import SESSION_FOR_CALL
from services.common.tokenization.lru import SizedLRU

log = logging.getLogger("polar.proxy")

STATE_TTL_SECONDS = 7 * 24 * 3600
# Decoded TITO states kept per proxy process (``DecodedStates``), in memory as estimated
# by ``state_cache_cost``: measured (tracemalloc), a state's decoded objects take about
# twice its stored bytes plus ~1 KiB, and the stored bytes are kept to check it with.
STATE_CACHE_BYTES = 32 << 20
STATE_ENTRY_BYTES = 1024


def state_cache_cost(stored: bytes) -> int:
    return 3 * len(stored) + STATE_ENTRY_BYTES


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TurnState)
SEQ_KEY = S.key_call_seq("")  # + session id
TITO_KEY = S.KEY_TITO_PREFIX

# Token -> session and that attempt's TITO states, numbering a model call to a RUNNING
# session: all a call needs before it goes to the engine, in one round trip. The script
# is the registry's (it owns the session hash); the keys it touches for us are ours.
_OPEN = Script(SESSION_FOR_CALL)
# Remember a numbered call's state (stored as "<seq>:<msgpack>", newest first), dropping
# the one it supersedes (ARGV[4], empty for none: see ``superseded``).
_REMEMBER = Script(
    "redis.call('LPUSH', KEYS[1], ARGV[1]) "
    "if ARGV[4] ~= '' then redis.call('LREM', KEYS[1], 1, ARGV[4]) end "
    "redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2])) "
    "redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))"
)
_RELEASE = Script(RELEASE_IF_LAST)


@dataclass(frozen=True)
class CallContext:
    """One harness call, as the handler saw it."""

    session_id: str
    attempt: int
    protocol: Protocol
    mode: UpstreamMode
    model: str
    raw_request: bytes
    normalized: bytes
    user_agent: str | None
    side_call: str | None
    received: float


@dataclass(frozen=True, slots=True)
class Opened:
    """A token's session as a model call needs it (``SESSION_FOR_CALL``'s reply)."""

    session_id: str
    attempt: int
    state: str  # a SessionState's value; '' for a session whose hash is gone
    task_id: str
    states: list[bytes]  # raw, newest first
    seq: int | None  # the call's number, when the lookup took one
    replay: bytes = b""  # the task's ReplaySpec json: a replay's session (proxy/replay.py)


class CallNumber:
    """A call's number, and its life. ``await`` it (as often as needed) once the lookup
    or the INCR that took it is back. Every number taken ends in one of three ways: its
    record committed (``commit``, ``start_commit``), or ``settle``: given back when no
    later call took one, else filled with a void record, so builders see no lost call."""

    __slots__ = ("_numbering", "_reply", "_seq")

    def __init__(
        self, numbering: Numbering, reply: Awaitable[int] | None, seq: int | None = None
    ) -> None:
        self._numbering, self._reply, self._seq = numbering, reply, seq

    def __await__(self):
        return self._value().__await__()

    async def _value(self) -> int:
        if self._seq is None:
            self._seq = int(await self._reply) - 1  # INCR answers how many are taken
        return self._seq

    async def commit(self, record: CompletionRecord) -> None:
        """Publish the call's record (numbered by this) and wait for its ack."""
        await commit(self._numbering.publisher, record)

    def start_commit(self, record: CompletionRecord) -> Coroutine:
        """``commit`` with the publish written at once (await the coroutine, or close it).
        A record whose number another call's record already has is refused, not dropped
        as a retry (``DuplicateMessage``): the session's counter went back (a Valkey
        failover lost its last writes), and the call is the harness's error, not a call
        silently missing from the capture."""
        return start_commit(self._numbering.publisher, record, new_only=True)

    async def settle(self, ctx: CallContext, reason: str, *, void: bool = True) -> None:
        """This call will have no record: the number is given back if no later call took
        one, else filled with a void record (``void``) so builders see no lost call."""
        try:
            seq = await self
        except (RedisUnavailable, RedisReplyError):
            return  # no number was taken
        try:
            if await self._numbering.store.release_seq(ctx.session_id, seq) or not void:
                return
            await commit(self._numbering.publisher, void_record(ctx, seq, reason))
        except (ProxyError, RedisUnavailable, RedisReplyError) as exc:
            log.warning("call %d of %s left a gap (%s): %s", seq, ctx.session_id, reason, exc)


class Numbering:
    """Hands out ``CallNumber``s: the one a session lookup took, or one taken now."""

    __slots__ = ("store", "publisher")

    def __init__(self, store: SessionStore, publisher: JetStreamPublisher) -> None:
        self.store, self.publisher = store, publisher

    def taken(self, seq: int) -> CallNumber:
        """A number the session lookup already took."""
        return CallNumber(self, None, seq)

    def reserve(self, session_id: str) -> CallNumber:
        """A number asked for now (a call in the grace window), awaited later."""
        return CallNumber(self, self.store.reserve(session_id))

    def of(self, session_id: str, seq: int | None) -> CallNumber:
        """The number the session lookup took, else one asked for now: it is back while
        the engine answers."""
        return CallNumber(self, None, seq) if seq is not None else self.reserve(session_id)


class SessionStore:
    """Per-session call numbering and TITO states, in Redis (through ``proxy.io.resp``).

    Per call: ``open`` before the engine (it also numbers a RUNNING session's call;
    ``reserve`` numbers one in the grace window while the engine answers); ``remember``
    while JetStream acks the record. Only ``open`` is waited for on its own.
    """

    def __init__(self, redis: Resp) -> None:
        self.redis = redis
        self.decoded = DecodedStates()

    def states(self, session_id: str, attempt: int, raw: list[bytes]) -> list[TurnState]:
        """The stored states ``open`` read, decoded (each once per proxy while cached)."""
        return self.decoded.decode(session_id, attempt, raw)

    def open(self, token: str, *, number: bool = False) -> Coroutine[Any, Any, Opened | None]:
        """The token's session and its attempt's stored TITO states (raw, newest first:
        ``states`` decodes them); None for an unknown token. ``number``: a model call, so
        a RUNNING session's call is numbered in the same round trip (``Opened.seq``).
        Asked for now: the caller reads the request body meanwhile (await the
        coroutine, or close it)."""
        sent = self.redis.start_script(
            _OPEN,
            [S.key_token(token)],
            [TITO_KEY, MAX_STATES - 1, "1" if number else "0", SEQ_KEY],
        )
        return self._opened(sent)

    async def _opened(self, sent: Awaitable) -> Opened | None:
        reply = await sent
        if not reply:
            return None
        (sid, attempt, state, task_id, replay), states, seq = reply
        return Opened(
            sid.decode(), int(attempt), state.decode(), task_id.decode(), states,
            None if seq < 0 else seq, replay,
        )  # fmt: skip

    def reserve(self, session_id: str) -> Awaitable[int]:
        """INCR the session's call counter: sent now, its reply (how many numbers are
        taken) awaited later (``CallNumber``)."""
        return self.redis.start("INCR", SEQ_KEY + session_id)

    def remember(
        self, session_id: str, attempt: int, state: TurnState, drop: bytes | None = None
    ) -> tuple[bytes, Awaitable]:
        """Store ``state`` (numbered: its ``seq`` is set) as the session's newest, and
        remove ``drop`` (a stored state it supersedes) in the same step: what was stored
        (for ``forget``) and the reply to await."""
        stored = b"%d:%s" % (state.seq, _encoder.encode(state))
        self.decoded.put(session_id, attempt, stored, state)  # its next call decodes nothing
        key = S.key_tito(session_id, attempt)
        return stored, self.redis.start_script(
            _REMEMBER, [key], [stored, MAX_STATES - 1, STATE_TTL_SECONDS, drop or b""]
        )

    async def forget(self, session_id: str, attempt: int, stored: bytes) -> None:
        """Undo ``remember`` (its call turned out not to be captured)."""
        await self.redis.call("LREM", S.key_tito(session_id, attempt), 1, stored)

    async def release_seq(self, session_id: str, seq: int) -> bool:
        """Give back a number whose record was never committed, if no call took a later
        one meanwhile: a failed capture then leaves no gap for builders to report as lost."""
        return bool(await self.redis.script(_RELEASE, [SEQ_KEY + session_id], [seq + 1]))


def superseded(raw: list[bytes], base: TurnState | None) -> bytes | None:
    """The stored state a call that continued ``base`` makes redundant: ``base``'s own
    base. A conversation that only grows so keeps two states, its tip and the one before
    (which a retry of the tip's call continues), not ``MAX_STATES`` snapshots of itself:
    a long session's lookup reads and decodes 2 histories, not 8, and other branches
    (sub-agents, side calls) are not pushed out by the main loop's turns."""
    if base is None or base.base is None:
        return None
    prefix = b"%d:" % base.base
    return next((item for item in raw if item.startswith(prefix)), None)


class _Known(NamedTuple):
    """One attempt's decoded states, by their stored number (the bytes before ``:``):
    the stored bytes (to check them with) and the state. Never changed once made: a
    change is a new one, so the LRU's accounting of its cost stays true."""

    by_seq: dict[bytes, tuple[bytes, TurnState]]
    cost: int


class DecodedStates:
    """Stored TITO states already decoded, so a session's calls do not decode its
    histories again on every call (a long conversation's two states are most of what its
    lookup reads: 0.6 ms of msgspec a call at 100 turns, ``tests/bench/bench_tito.py``).
    Kept per (session, attempt), one LRU entry each (one lookup a call, not one a state),
    and a state used only while its stored bytes are the same (a number given back is
    taken again by another state); least recently used attempts out first, within
    ``budget`` bytes of memory (``state_cache_cost``), an attempt keeping at most
    ``MAX_STATES`` states. Cached states are shared by the calls that read them: nothing
    may change one.
    """

    def __init__(self, budget: int = STATE_CACHE_BYTES) -> None:
        self.lru: SizedLRU[tuple[str, int], _Known] = SizedLRU(budget, lambda _k, known: known.cost)

    def decode(self, session_id: str, attempt: int, raw: list[bytes]) -> list[TurnState]:
        known = self.lru.get((session_id, attempt))
        by_seq = known.by_seq if known is not None else {}
        states = []
        fresh: list[tuple[bytes, TurnState]] | None = None
        for item in raw:
            hit = by_seq.get(item.partition(b":")[0])
            if hit is not None and hit[0] == item:
                states.append(hit[1])
                continue
            state = decode_state(item)
            states.append(state)
            if fresh is None:
                fresh = []
            fresh.append((item, state))
        if fresh:  # what was read is what the attempt has now: kept as such
            stored = {item.partition(b":")[0] for item in raw}
            kept = {seq: hit for seq, hit in by_seq.items() if seq in stored}
            cost = sum(state_cache_cost(item) for item, _ in kept.values())
            self._keep(session_id, attempt, kept, cost, fresh)
        return states

    def put(self, session_id: str, attempt: int, stored: bytes, state: TurnState) -> None:
        known = self.lru.get((session_id, attempt))
        by_seq, cost = (dict(known.by_seq), known.cost) if known is not None else ({}, 0)
        self._keep(session_id, attempt, by_seq, cost, [(stored, state)])

    def _keep(
        self,
        session_id: str,
        attempt: int,
        by_seq: dict[bytes, tuple[bytes, TurnState]],
        cost: int,  # of what ``by_seq`` holds: kept up to date, not summed again
        new: list[tuple[bytes, TurnState]],
    ) -> None:
        for stored, state in new:
            added = state_cache_cost(stored)
            if added > self.lru.budget // 8:  # one huge history: not kept
                continue
            seq = stored.partition(b":")[0]
            replaced = by_seq.get(seq)
            if replaced is not None:
                cost -= state_cache_cost(replaced[0])
            by_seq[seq] = (stored, state)
            cost += added
        while len(by_seq) > MAX_STATES:  # the oldest numbers go first
            cost -= state_cache_cost(by_seq.pop(min(by_seq, key=int))[0])
        self.lru.put((session_id, attempt), _Known(by_seq, cost))

    def __len__(self) -> int:
        """How many states are kept decoded."""
        return sum(len(known.by_seq) for known in self.lru.entries.values())


def decode_state(item: bytes) -> TurnState:
    """A stored state (``"<seq>:<msgpack>"``) -> its TurnState."""
    seq, _, encoded = item.partition(b":")
    state = _decoder.decode(encoded)
    state.seq = int(seq)
    return state


def decode_states(raw: list[bytes]) -> list[TurnState]:
    """Stored states (newest first) -> TurnStates."""
    return [decode_state(item) for item in raw]


def build_record(
    ctx: CallContext,
    seq: int,
    plan: PromptPlan,
    gen: Generation,
    *,
    aborted: bool = False,
    error: str | None = None,
    queue_ms: float = 0.0,
    finish: str | None = None,
    reply: dict | None = None,
    tool_parse: ToolParse | None = None,
    routing: RoutedExperts | None = None,
    replay: ReplayMark | None = None,
) -> CompletionRecord:
    """The call's record; ``finish`` is the turn's reason as the harness was told it
    (``tool_calls`` for a turn that calls tools, whoever parsed them), else the engine's;
    ``reply`` the assistant message it was answered with (what a trainer's conversation
    ends with), when the answer was parsed."""
    if plan.base is None:
        base_seq, base_len, tail = None, 0, plan.prompt_ids
    else:  # planning compared the prompt with the base's ids already, or this does now
        shared = plan.shared
        if shared is None:
            shared = common_prefix_length(plan.prompt_ids, plan.base.sampled_ids())
        base_seq, base_len, tail = delta_at(plan.prompt_ids, plan.base.seq, shared)
    return CompletionRecord(
        session_id=ctx.session_id,
        seq=seq,
        attempt=ctx.attempt,
        protocol=ctx.protocol,
        mode=ctx.mode,
        model=ctx.model,
        served_model=gen.served_model,
        raw_request=msgspec.Raw(ctx.raw_request or b"null"),
        normalized=msgspec.Raw(ctx.normalized),
        reply=msgspec.Raw(orjson.dumps(reply) if reply is not None else b"null"),
        prompt_ids=tail,
        prompt_base_seq=base_seq,
        prompt_base_len=base_len,
        images=list(plan.images),
        output_ids=gen.output_ids,
        output_logprobs=gen.output_logprobs,
        finish_reason="abort" if aborted else (finish or gen.finish_reason),
        weight_version=gen.weight_version,
        # one version throughout is what weight_version already says
        weight_versions=gen.weight_versions if len(gen.weight_versions) > 1 else [],
        weight_version_starts=gen.weight_version_starts if len(gen.weight_versions) > 1 else [],
        timings=Timings(
            received=ctx.received,
            upstream_start=gen.upstream_start,
            upstream_end=gen.upstream_end,
            captured=time.time(),
            queue_ms=queue_ms,
        ),
        user_agent=ctx.user_agent,
        side_call=ctx.side_call,
        extends_previous=plan.extends,
        drift_reason=plan.drift_reason,
        tool_parse=tool_parse,
        routing=routing,
        replay=replay,
        aborted=aborted,
        error=error,
    )


def void_record(
    ctx: CallContext, seq: int, reason: str, replay: ReplayMark | None = None
) -> CompletionRecord:
    """Fills the number of a call that failed before anything was sampled (engine
    error, bad prompt), when a later call's number makes giving it back impossible."""
    empty = Generation(prompt_ids=[], output_ids=[], output_logprobs=[], finish_reason="error")
    plan = PromptPlan([], None, None, None)
    return build_record(ctx, seq, plan, empty, error=reason, replay=replay)


async def commit(publisher: JetStreamPublisher, record: CompletionRecord) -> None:
    """Publish and wait for the JetStream ack; a failure is the harness's error. (Any
    object with ``publish`` will do, e.g. a ``Bus``.)"""
    subject, payload, msg_id = _addressed(record)
    await _acked(publisher.publish(subject, payload, msg_id=msg_id))


def start_commit(
    publisher: JetStreamPublisher, record: CompletionRecord, *, new_only: bool = False
) -> Coroutine:
    """``commit`` with the publish written at once (await the coroutine, or close it)."""
    subject, payload, msg_id = _addressed(record)
    return _acked(publisher.start(subject, payload, msg_id=msg_id, new_only=new_only))


def _addressed(record: CompletionRecord) -> tuple[str, bytes, str]:
    # the message id makes JetStream drop a retried publish of the same call
    sid = record.session_id
    return S.completions(sid), encode(record), S.completion_msg_id(sid, record.seq)


async def _acked(sent: Awaitable[int]) -> None:
    try:
        await sent
    except Exception as exc:  # noqa: BLE001 - any failure means the call is not captured
        raise UpstreamError(503, f"capture failed: {exc}", ErrorKind.CAPTURE_FAILED) from exc


def normalized_json(messages: list[dict], tools: list[dict] | None) -> bytes:
    return orjson.dumps({"messages": messages, "tools": tools or []})
