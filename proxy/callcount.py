"""The proxy's count of a session's model calls, read by other services through here.

The proxy owns ``polar:seq:<session>`` (it numbers each call in its capture script);
the executor asks whether a harness called the model at all without knowing the key.
"""

from __future__ import annotations

from schemas import subjects as S


async def numbered_calls(redis, session_id: str) -> int:
    """Model calls of the session the proxy has numbered so far (all attempts)."""
    return int(await redis.get(S.key_call_seq(session_id)) or 0)
