"""Cancels asked of sessions past their run (POSTRUN, BUILDING, EVALUATING).

Such a session is ending anyway: it is left to be built, evaluated and delivered, so its
group is whole (``services/common/finish.py``). But one whose build or evaluation died
with its service's process would end only once quarantined, deaths later
(``services/common/quarantine.py``). So the scheduler keeps the cancel here (``ask``), and
a service that would run such a suspect again ends it at once instead (``asked``: its
consumer's ``give_up``).
"""

from __future__ import annotations

from redis.asyncio import Redis

from schemas import subjects as S

TTL_S = 24 * 3600.0


async def ask(redis: Redis, session_id: str, reason: str) -> None:
    await redis.set(S.key_cancel_asked(session_id), reason or "cancelled", ex=int(TTL_S))


async def asked(redis: Redis, session_id: str) -> str | None:
    """The reason of the cancel asked of ``session_id``, if one was."""
    raw = await redis.get(S.key_cancel_asked(session_id))
    return raw.decode("utf-8", "replace") if raw is not None else None
