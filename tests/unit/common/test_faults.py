"""``retry_faults``: a fault of the system is tried again, boundedly; anything else is not."""

import asyncio

import pytest
import redis.exceptions

from services.common.faults import retry_faults


def test_a_fault_is_tried_again_until_the_call_answers():
    calls, told = [], []

    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise redis.exceptions.ConnectionError("down")
        return "ok"

    got = asyncio.run(
        retry_faults(flaky, seconds=5, first_delay=0.01, on_retry=lambda e, d: told.append(d))
    )
    assert got == "ok" and len(calls) == 3 and told == [0.01, 0.02]


def test_past_its_seconds_the_last_fault_is_raised():
    async def down():
        raise TimeoutError("still down")

    with pytest.raises(TimeoutError):
        asyncio.run(retry_faults(down, seconds=0.05, first_delay=0.01))


def test_an_error_that_is_no_fault_of_the_system_is_raised_at_once():
    calls = []

    async def wrong():
        calls.append(1)
        raise ValueError("bad input")

    with pytest.raises(ValueError):
        asyncio.run(retry_faults(wrong, seconds=5, first_delay=0.01))
    assert calls == [1]


def test_a_registry_refusing_writes_in_a_failover_is_a_fault_of_the_system():
    from services.common.faults import is_transient, registry_refuses_writes

    norep = redis.exceptions.ResponseError("NOREPLICAS Not enough good replicas to write.")
    readonly = redis.exceptions.ReadOnlyError("You can't write against a read only replica.")
    wrongtype = redis.exceptions.ResponseError("WRONGTYPE Operation against a key")
    assert registry_refuses_writes(norep) and registry_refuses_writes(readonly)
    assert is_transient(norep) and is_transient(readonly)
    assert not registry_refuses_writes(wrongtype) and not is_transient(wrongtype)
