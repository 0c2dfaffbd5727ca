"""``ensure_consumer`` asks JetStream again when a create times out (idempotent), and
gives up with the timeout after its tries. The JetStream context here is a stand-in that
times out on cue: a real server cannot be made to stall on demand."""

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig

from services.common import bus


class Stalling:
    def __init__(self, stalls: int) -> None:
        self.stalls, self.calls = stalls, 0

    async def add_consumer(self, stream, cfg):
        self.calls += 1
        if self.calls <= self.stalls:
            raise NatsTimeoutError
        return cfg


async def test_a_timed_out_create_is_asked_again(monkeypatch):
    monkeypatch.setattr(bus.asyncio, "sleep", _no_wait)
    js = Stalling(stalls=2)
    await bus.ensure_consumer(js, "POLAR_SESSIONS", ConsumerConfig(durable_name="evaluator"))
    assert js.calls == 3


async def test_it_gives_up_with_the_timeout_after_its_tries(monkeypatch):
    monkeypatch.setattr(bus.asyncio, "sleep", _no_wait)
    js = Stalling(stalls=bus.CONSUMER_CREATE_TRIES)
    with pytest.raises(NatsTimeoutError):
        await bus.ensure_consumer(js, "POLAR_SESSIONS", ConsumerConfig(durable_name="evaluator"))
    assert js.calls == bus.CONSUMER_CREATE_TRIES


async def _no_wait(_seconds: float) -> None:
    return None
