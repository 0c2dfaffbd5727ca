"""An evaluator's own model calls (a judge's), recorded as the session's side calls.

Numbered by the proxy's call counter (``proxy/callcount.py``, its owner) after every call
the harness made, published on ``polar.completions.<session>`` under the same dedupe id
as the proxy's records. The builder has built the trajectory by then and never builds
this attempt again (the session is EVALUATING), so they reach the session's records
(the dashboard) and no trajectory.
"""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from evaluators import EvaluatorError
from proxy.callcount import number_call, release_call
from schemas import CompletionRecord, encode
from schemas import subjects as S
from services.common.bus import Bus

log = logging.getLogger(__name__)


class SessionSideCalls:
    """``evaluators.base.SideCalls`` for one session: its records, on the bus."""

    def __init__(self, bus: Bus, redis, session_id: str) -> None:
        self.bus, self.redis, self.session_id = bus, redis, session_id

    async def number(self) -> int:
        try:
            return await number_call(self.redis, self.session_id)
        except (RedisError, OSError) as exc:
            raise EvaluatorError(f"no call number for a side call: {exc!r}") from None

    async def commit(self, record: CompletionRecord) -> None:
        if record.session_id != self.session_id:
            raise EvaluatorError(f"a side call of {record.session_id!r} is not this session's")
        subject = S.completions(self.session_id)
        try:
            await self.bus.send(
                subject, encode(record), msg_id=S.completion_msg_id(self.session_id, record.seq)
            )
        except Exception as exc:  # noqa: BLE001 - nats' errors, translated once here
            await self._give_back(record.seq)
            raise EvaluatorError(f"the side call's record was not committed: {exc!r}") from None

    async def _give_back(self, seq: int) -> None:
        try:
            await release_call(self.redis, self.session_id, seq)
        except (RedisError, OSError) as exc:  # the record's failure is what the caller sees
            log.warning("%s: side call %d left a gap: %r", self.session_id, seq, exc)
