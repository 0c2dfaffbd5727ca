"""Kept evaluation results (Redis hash ``polar:eval:<session>:<attempt>``).

An evaluation is done once per session attempt: its result is kept before anything is
delivered, so a redelivered message (the service died midway) delivers the same result
instead of evaluating again. ``published`` marks the scored trajectory as sent;
``fresh`` marks that a fresh eval runtime may have been created (to be stopped).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from evaluators import EvalResult
from schemas import subjects as S
from services.evaluator.logic import decode_result, encode_result


@dataclass(frozen=True)
class Record:
    result: EvalResult | None
    published: bool
    fresh: bool


class EvalRecords:
    def __init__(self, redis: aioredis.Redis, ttl_seconds: float) -> None:
        self.redis, self.ttl = redis, int(ttl_seconds)

    async def get(self, session_id: str, attempt: int) -> Record | None:
        raw = await self.redis.hgetall(S.key_eval(session_id, attempt))
        if not raw:
            return None
        result = raw.get(b"result")
        return Record(
            result=decode_result(result) if result else None,
            published=raw.get(b"published") == b"1",
            fresh=raw.get(b"fresh") == b"1",
        )

    async def _set(self, session_id: str, attempt: int, field: str, value: bytes | str) -> None:
        key = S.key_eval(session_id, attempt)
        async with self.redis.pipeline(transaction=True) as p:
            p.hset(key, field, value)
            p.expire(key, self.ttl)
            await p.execute()

    async def note_fresh(self, session_id: str, attempt: int) -> None:
        await self._set(session_id, attempt, "fresh", "1")

    async def keep(self, session_id: str, attempt: int, result: EvalResult) -> EvalResult:
        """Keep ``result`` unless one is kept already; returns the kept one (as decoded)."""
        key = S.key_eval(session_id, attempt)
        async with self.redis.pipeline(transaction=True) as p:
            p.hsetnx(key, "result", encode_result(result))
            p.expire(key, self.ttl)
            p.hget(key, "result")
            _, _, kept = await p.execute()
        return decode_result(kept)

    async def mark_published(self, session_id: str, attempt: int) -> bool:
        """Mark the scored trajectory sent; returns the record's ``fresh`` flag (read in
        the same round trip: what finishing the session needs to know)."""
        key = S.key_eval(session_id, attempt)
        async with self.redis.pipeline(transaction=True) as p:
            p.hset(key, "published", "1")
            p.expire(key, self.ttl)
            p.hget(key, "fresh")
            *_, fresh = await p.execute()
        return fresh == b"1"

    async def delete(self, session_id: str, attempt: int) -> None:
        await self.redis.delete(S.key_eval(session_id, attempt))
