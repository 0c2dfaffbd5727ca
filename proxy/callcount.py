"""The proxy's count of a session's model calls, read by other services through here.

The proxy owns ``polar:seq:<session>`` (it numbers each call in its capture script);
the executor asks whether a harness called the model at all without knowing the key,
and the evaluator numbers its side calls (a judge's) after the harness's calls.
"""

from __future__ import annotations

from schemas import subjects as S
from services.common.registry import expire

# DECR the session's call counter only if ARGV[1] (seq + 1) is still how many are taken
RELEASE_IF_LAST = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DECR', KEYS[1]); return 1 end; "
    "return 0"
)


async def numbered_calls(redis, session_id: str) -> int:
    """Model calls of the session the proxy has numbered so far (all attempts)."""
    return int(await redis.get(S.key_call_seq(session_id)) or 0)


async def number_call(redis, session_id: str) -> int:
    """The next call number of the session, for a call made on its behalf outside the
    proxy (an evaluator's judge, after the run): no proxy call has it or will."""
    return int(await redis.incr(S.key_call_seq(session_id))) - 1


async def release_call(redis, session_id: str, seq: int) -> bool:
    """Give back ``seq`` (its record was not committed) if no later number was taken."""
    return bool(await redis.eval(RELEASE_IF_LAST, 1, S.key_call_seq(session_id), seq + 1))


async def forget_calls(redis, session_ids: list[str], seconds: float) -> None:
    """The sessions' call numbers expire ``seconds`` from now (their task ended: the
    retention policy); a session that made no call has none."""
    await expire(redis, [S.key_call_seq(sid) for sid in session_ids], seconds)
