"""Session tokens -> sessions. A token is valid while its session is RUNNING, and for a
grace window after it left RUNNING (a harness's last call may race its own exit)."""

from __future__ import annotations

import time

from proxy.app import SessionInfo
from schemas import SessionState
from services.common.registry import Registry

_BEFORE_RUNNING = frozenset(
    {SessionState.REGISTERED, SessionState.INITIALIZING, SessionState.READY}
)


def token_valid(state: SessionState, updated_at: float, now: float, grace: float) -> bool:
    if state == SessionState.RUNNING:
        return True
    if state in _BEFORE_RUNNING:
        return False
    return now - updated_at <= grace


class SessionResolver:
    def __init__(self, registry: Registry, *, grace_seconds: float, cache_seconds: float = 1.0):
        self.registry, self.grace, self.cache_seconds = registry, grace_seconds, cache_seconds
        self._cache: dict[str, tuple[float, SessionInfo]] = {}

    async def __call__(self, token: str) -> SessionInfo | None:
        now = time.time()
        hit = self._cache.get(token)
        if hit is not None and hit[0] > now:
            return hit[1]
        session = await self.registry.session_by_token(token)
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
