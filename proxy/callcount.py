"""The proxy's count of a session's model calls, read by other services through here.

The proxy owns ``polar:seq:<session>`` (it numbers each call in its capture script);
the executor asks whether a harness called the model at all without knowing the key.
"""

from __future__ import annotations

from schemas import subjects as S
from services.common.registry import expire


async def numbered_calls(redis, session_id: str) -> int:
    """Model calls of the session the proxy has numbered so far (all attempts)."""
    return int(await redis.get(S.key_call_seq(session_id)) or 0)


async def forget_calls(redis, session_ids: list[str], seconds: float) -> None:
    """The sessions' call numbers expire ``seconds`` from now (their task ended: the
    retention policy); a session that made no call has none."""
    await expire(redis, [S.key_call_seq(sid) for sid in session_ids], seconds)
