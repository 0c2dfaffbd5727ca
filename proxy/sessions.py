"""Session tokens -> sessions. A token is valid while its session is RUNNING, and only
then: the session's capture closes when it leaves RUNNING (its token key is deleted in
that same transition, ``transition.lua``), so a later call is refused with a 401 in the
caller's protocol rather than served and captured after the builder read the session.

No cache: the lookup is one round trip that also brings the session's TITO states
(``SessionStore.open``), which every model call needs anyway and which runs while the
request body is read and parsed; a session that left RUNNING loses its token at once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Coroutine
from typing import Any

from proxy.app import SessionInfo
from proxy.capture import Opened, SessionStore
from schemas import SessionState


class SessionResolver:
    """Token -> SessionInfo with the attempt, the task, the raw TITO states
    (decoded by ``SessionStore.states``) and the call's number for the completion handler."""

    def __init__(self, store: SessionStore):
        self.store = store

    def __call__(
        self, token: str, for_call: bool = False
    ) -> Coroutine[Any, Any, SessionInfo | None]:
        """The lookup is sent now; the coroutine returned waits for it (the proxy reads
        and parses the request body meanwhile). ``for_call``: a model call, numbered in
        the same round trip when the session is RUNNING (``SessionInfo.seq``)."""
        return self._resolve(self.store.open(token, number=for_call))

    async def _resolve(self, opening: Awaitable[Opened | None]) -> SessionInfo | None:
        opened = await opening
        if opened is None:
            return None
        if opened.state != SessionState.RUNNING:
            return None  # not RUNNING: no number was taken
        return SessionInfo(
            session_id=opened.session_id,
            attempt=opened.attempt,
            task_id=opened.task_id,
            states=opened.states,
            seq=opened.seq,
            replay=opened.replay,
        )
