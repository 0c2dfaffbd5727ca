"""Session tokens -> sessions. A token is valid while its session is RUNNING, and for a
grace window after it left RUNNING (a harness's last call may race its own exit).

No cache: the lookup is one round trip that also brings the session's TITO states
(``SessionStore.open``), which every model call needs anyway and which runs while the
request body is read and parsed; a session that left RUNNING loses its token at once.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Coroutine
from typing import Any

from proxy.app import SessionInfo
from proxy.capture import Opened, SessionStore
from schemas import SessionState

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
    """Token -> SessionInfo whose ``data`` carries the attempt, the task and the raw TITO
    states (``proxy.capture.decode_states``) for the completion handler."""

    def __init__(self, store: SessionStore, *, grace_seconds: float):
        self.store, self.grace = store, grace_seconds

    def __call__(
        self, token: str, for_call: bool = False
    ) -> Coroutine[Any, Any, SessionInfo | None]:
        """The lookup is sent now; the coroutine returned waits for it (the proxy reads
        and parses the request body meanwhile). ``for_call``: a model call, numbered in
        the same round trip when the session is RUNNING (``data["seq"]``)."""
        return self._resolve(self.store.open(token, number=for_call))

    async def _resolve(self, opening: Awaitable[Opened | None]) -> SessionInfo | None:
        opened = await opening
        if opened is None:
            return None
        session = opened.session
        if not token_valid(session.state, session.updated_at, time.time(), self.grace):
            return None  # not RUNNING: no number was taken
        data = {
            "attempt": session.attempt,
            "task_id": session.task_id,
            "states": opened.states,
            "seq": opened.seq,
        }
        return SessionInfo(session_id=session.session_id, data=data)
