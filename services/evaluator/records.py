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


# Set a field of the record (KEYS[1]) and its time to live (ARGV[3] s), and return the
# value of field ARGV[4], in one step: one command where a MULTI of three was (the
# evaluator writes the record twice per session).
_SET_AND_GET = """
if ARGV[5] == 'nx' then
  redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return redis.call('HGET', KEYS[1], ARGV[4])
"""


class EvalRecords:
    def __init__(self, redis: aioredis.Redis, ttl_seconds: float) -> None:
        self.redis, self.ttl = redis, int(ttl_seconds)
        self._set_and_get = redis.register_script(_SET_AND_GET)

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

    async def note_fresh(self, session_id: str, attempt: int) -> None:
        key = S.key_eval(session_id, attempt)
        await self._set_and_get(keys=[key], args=["fresh", "1", self.ttl, "fresh", ""])

    async def keep(self, session_id: str, attempt: int, result: EvalResult) -> EvalResult:
        """Keep ``result`` unless one is kept already; returns the kept one (as decoded)."""
        key = S.key_eval(session_id, attempt)
        args = ["result", encode_result(result), self.ttl, "result", "nx"]
        return decode_result(await self._set_and_get(keys=[key], args=args))

    async def mark_published(self, session_id: str, attempt: int) -> bool:
        """Mark the scored trajectory sent; returns the record's ``fresh`` flag (read in
        the same round trip: what finishing the session needs to know)."""
        key = S.key_eval(session_id, attempt)
        args = ["published", "1", self.ttl, "fresh", ""]
        return await self._set_and_get(keys=[key], args=args) == b"1"

    async def delete(self, session_id: str, attempt: int) -> None:
        await self.redis.delete(S.key_eval(session_id, attempt))
