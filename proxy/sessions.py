"""Session tokens -> sessions. A token is valid while its session is RUNNING, and for a
grace window after it left RUNNING (a harness's last call may race its own exit)."""

from __future__ import annotations

import time

import msgspec

from proxy.app import SessionInfo
from proxy.resp import Resp, Script
from schemas import Session, SessionState
from schemas import subjects as S

# The registry's token -> session lookup (GET, then HGETALL) in one round trip.
_LOOKUP = Script(
    "local sid = redis.call('GET', KEYS[1]) "
    "if not sid then return false end "
    "return redis.call('HGETALL', ARGV[1] .. sid)"
)

_BEFORE_RUNNING = frozenset(
    {SessionState.REGISTERED, SessionState.INITIALIZING, SessionState.READY}
)


def token_valid(state: SessionState, updated_at: float, now: float, grace: float) -> bool:
    if state == SessionState.RUNNING:
        return True
    if state in _BEFORE_RUNNING:
        return False
    return now - updated_at <= grace


async def session_by_token(redis: Resp, token: str) -> Session | None:
    row = await redis.script(_LOOKUP, [S.key_token(token)], [S.key_session("")])
    if not row:
        return None
    fields = {k.decode(): v.decode() for k, v in zip(row[::2], row[1::2], strict=True)}
    return msgspec.convert(fields, Session, strict=False)


class SessionResolver:
    """Token -> session, from the registry's keys (read through ``proxy.resp``: a harness's
    calls are seconds apart, so most calls miss the short cache and pay this lookup)."""

    def __init__(self, redis: Resp, *, grace_seconds: float, cache_seconds: float = 1.0):
        self.redis, self.grace, self.cache_seconds = redis, grace_seconds, cache_seconds
        self._cache: dict[str, tuple[float, SessionInfo]] = {}

    async def __call__(self, token: str) -> SessionInfo | None:
        now = time.time()
        hit = self._cache.get(token)
        if hit is not None and hit[0] > now:
            return hit[1]
        session = await session_by_token(self.redis, token)
        if session is None or not token_valid(session.state, session.updated_at, now, self.grace):
            self._cache.pop(token, None)
            return None
        info = SessionInfo(
            session_id=session.session_id,
            data={"attempt": session.attempt, "task_id": session.task_id},
        )
        if session.state == SessionState.RUNNING:  # only a live session is worth caching
            if len(self._cache) > 100_000:
                self._cache.clear()
            self._cache[token] = (now + self.cache_seconds, info)
        return info
