"""Capture: every model call becomes a CompletionRecord in JetStream before the harness
sees its answer. If the record cannot be committed, the harness gets an error instead.

Session state the proxy needs across calls (the call sequence number and the TITO turn
states) lives in Redis, so proxy replicas stay stateless.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
import orjson

from proxy.backends.base import Generation
from proxy.errors import ErrorKind, UpstreamError
from proxy.resp import Resp, Script
from proxy.tito import MAX_STATES, PromptPlan, TurnState
from schemas import CompletionRecord, Protocol, Timings, UpstreamMode, encode
from schemas import subjects as S
from schemas.completion import delta_encode
from services.common.bus import Bus

STATE_TTL_SECONDS = 7 * 24 * 3600
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TurnState)
# LPUSH, LTRIM, EXPIRE in one atomic command (one round trip, one reply to parse)
_REMEMBER = Script(
    "redis.call('LPUSH', KEYS[1], ARGV[1]); "
    "redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2])); "
    "redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3])); return 1"
)

# DECR the session's call counter only if ``seq`` is still the last number handed out
_RELEASE = Script(
    "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DECR', KEYS[1]); return 1 end; "
    "return 0"
)


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


class SessionStore:
    """Per-session call numbering and TITO states, in Redis (``proxy.resp``: these are
    three commands of every call, on the proxy's hot path)."""

    def __init__(self, redis: Resp) -> None:
        self.redis = redis

    def _key(self, session_id: str, attempt: int) -> str:
        return f"polar:tito:{session_id}:{attempt}"

    async def next_seq(self, session_id: str) -> int:
        return int(await self.redis.call("INCR", f"polar:seq:{session_id}")) - 1

    async def release_seq(self, session_id: str, seq: int) -> bool:
        """Give back a number whose record was never committed, if no call took a later
        one meanwhile: a failed capture then leaves no gap for builders to report as lost."""
        return bool(await self.redis.script(_RELEASE, [f"polar:seq:{session_id}"], [seq + 1]))

    async def states(self, session_id: str, attempt: int) -> list[TurnState]:
        raw = await self.redis.call("LRANGE", self._key(session_id, attempt), 0, MAX_STATES - 1)
        return [_decoder.decode(r) for r in raw]

    async def remember(self, session_id: str, attempt: int, state: TurnState) -> bytes:
        """Store ``state`` as the newest; returns its encoding (to ``forget`` it again)."""
        key = self._key(session_id, attempt)
        encoded = _encoder.encode(state)
        await self.redis.script(_REMEMBER, [key], [encoded, MAX_STATES - 1, STATE_TTL_SECONDS])
        return encoded

    async def forget(self, session_id: str, attempt: int, encoded: bytes) -> None:
        """Undo ``remember`` (its call turned out not to be captured)."""
        await self.redis.call("LREM", self._key(session_id, attempt), 1, encoded)


def build_record(
    ctx: CallContext,
    seq: int,
    plan: PromptPlan,
    gen: Generation,
    *,
    aborted: bool = False,
    error: str | None = None,
    queue_ms: float = 0.0,
) -> CompletionRecord:
    previous = None
    if plan.base is not None:
        previous = (plan.base.seq, plan.base.prompt_ids + plan.base.output_ids)
    base_seq, base_len, tail = delta_encode(plan.prompt_ids, previous)
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
        prompt_ids=tail,
        prompt_base_seq=base_seq,
        prompt_base_len=base_len,
        output_ids=gen.output_ids,
        output_logprobs=gen.output_logprobs,
        finish_reason="abort" if aborted else gen.finish_reason,
        weight_version=gen.weight_version,
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
        aborted=aborted,
        error=error,
    )


async def commit(bus: Bus, record: CompletionRecord) -> None:
    """Publish and wait for the JetStream ack; a failure is the harness's error."""
    try:
        await bus.publish(
            S.completions(record.session_id),
            encode(record),
            msg_id=f"{record.session_id}:{record.seq}",
        )
    except Exception as exc:  # noqa: BLE001 - any failure means the call is not captured
        raise UpstreamError(503, f"capture failed: {exc}", ErrorKind.CAPTURE_FAILED) from exc


def normalized_json(messages: list[dict], tools: list[dict] | None) -> bytes:
    return orjson.dumps({"messages": messages, "tools": tools or []})
