"""Lifecycle events on the bus: a consumer tolerates fields a newer producer added (the
contract grows without a flag day), and a bad event is a ContractError naming the
problem."""

from __future__ import annotations

import orjson
import pytest

from schemas import ContractError, Outcome, decode_event, encode
from schemas.events import Artifacts, InitWork, SessionFinished


def with_extra(event, **extra) -> bytes:
    raw = orjson.loads(encode(event))
    raw.update(extra)
    return orjson.dumps(raw)


@pytest.mark.parametrize(
    "event",
    [
        InitWork(session_id="t-0000", task_id="t", priority=2, attempt=1),
        SessionFinished(
            session_id="t-0000",
            task_id="t",
            attempt=0,
            outcome=Outcome.TIMEOUT,
            reason="agent timeout after 2s: process tree killed",
            artifacts=Artifacts(exit_code=None, harness="shell"),
        ),
    ],
)
def test_unknown_fields_on_the_bus_are_tolerated(event):
    newer = with_extra(event, added_by_a_newer_producer={"x": [1, 2]}, another=3)
    assert decode_event(newer) == event


def test_an_unknown_event_type_or_a_wrong_field_is_named():
    with pytest.raises(ContractError) as unknown:
        decode_event(b'{"type": "session.teleported", "session_id": "t-0000"}')
    assert "session.teleported" in str(unknown.value)
    bad = with_extra(InitWork(session_id="t-0000", task_id="t"), priority="high")
    with pytest.raises(ContractError) as wrong:
        decode_event(bad)
    assert wrong.value.field == "$.priority"
