"""Call numbering and capture, round trips overlapped: the completion handler against a
real Redis and a real JetStream, with an engine whose answers and failures the test
times (``Engine``), so each failure lands exactly where it is meant to.

A call's number is taken while the engine answers; its state is stored while JetStream
acks its record. Every number ends in a committed record, or is given back, or is filled
by a void record: the builder never sees a lost call that was not lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis

from proxy import metrics
from proxy.backends.base import BackendError, ChatRequest, ErrorKind, Generation
from proxy.capture import SEQ_KEY, TITO_KEY, SessionStore
from proxy.conversation import Conversation, ImagePart, Message, TextPart
from proxy.errors import ProtocolError, UpstreamError
from proxy.gate import WeightGate
from proxy.handler import CompletionHandler
from proxy.io.resp import Resp
from proxy.sessions import SessionResolver
from schemas import SessionState, UpstreamMode
from schemas import subjects as S
from services.builder.integrity import assess
from services.builder.strategies.base import full_calls
from services.common.bus import CLAIM_THRESHOLD, Bus
from services.common.jspub import JetStreamPublisher
from services.common.registry import Registry
from services.common.tokenization import ChatTokenizer
from tests.helpers.stack import new_session
from tests.integration.proxy_agents import captured
from tests.unit.engine.tiny import tiny_model_dir


class Engine:
    """Chat-mode engine: each call waits for its go-ahead, then answers or fails."""

    def __init__(self) -> None:
        self.started: asyncio.Queue[str] = asyncio.Queue()
        self.go: dict[str, asyncio.Future[Callable[[], Generation]]] = {}

    def release(self, text: str, outcome: Callable[[], Generation]) -> None:
        self.go.setdefault(text, asyncio.get_running_loop().create_future()).set_result(outcome)

    async def chat(self, req: ChatRequest) -> Generation:
        text = req.messages[-1]["content"]
        await self.started.put(text)
        outcome = self.go.setdefault(text, asyncio.get_running_loop().create_future())
        return (await outcome)()


def answer(i: int) -> Callable[[], Generation]:
    return lambda: Generation(
        prompt_ids=[1, 2, 3, i], output_ids=[7, i], output_logprobs=[-0.5, -0.25],
        finish_reason="stop", text=f"answer {i}",
    )  # fmt: skip


def fail() -> Generation:
    raise BackendError(ErrorKind.CONTEXT_LENGTH, "prompt too long", status=400)


def as_is(turn):  # the app renders the answer; here the call returns the turn itself
    return turn


def conv(text: str) -> Conversation:
    return Conversation(model="m", messages=[Message(role="user", content=[TextPart(text)])])


@contextlib.asynccontextmanager
async def handler_on(nats_url: str, redis_url: str, bus: Bus, tokenizer=None):
    """Chat mode, or token mode with ``tokenizer`` (its calls must fail before the engine:
    this engine answers chat requests only)."""
    redis = Resp.from_url(redis_url)
    publisher = JetStreamPublisher(
        nats_url, name="test-numbering", fallback=bus.publish, fallback_above=CLAIM_THRESHOLD
    )
    store, engine = SessionStore(redis), Engine()
    mode = UpstreamMode.TOKEN if tokenizer is not None else UpstreamMode.CHAT
    handler = CompletionHandler(
        publisher=publisher, store=store, backend=engine, gate=WeightGate(),
        mode=mode, tokenizer=tokenizer, default_max_tokens=16,
    )  # fmt: skip
    try:
        yield handler, engine, SessionResolver(store)
    finally:
        await publisher.aclose()
        await redis.aclose()


@pytest.fixture
async def stack(nats_url, redis_url, bus):
    async with handler_on(nats_url, redis_url, bus) as parts:
        yield parts


async def call(handler, resolver, token: str, text: str):
    session = await resolver(token, True)  # a model call: the lookup numbers it
    return await handler.prepare(conv(text), "openai_chat", b'{"x": 1}', {})(session, as_is)


async def test_a_failed_call_gives_its_number_back(stack, bus, redis_client):
    handler, engine, resolver = stack
    s = await new_session(redis_client, "numbering-seq")
    engine.release("one", answer(1))
    engine.release("bad", fail)
    engine.release("two", answer(2))
    await call(handler, resolver, s.token, "one")
    with pytest.raises(UpstreamError) as caught:
        await call(handler, resolver, s.token, "bad")
    assert caught.value.status == 400
    await call(handler, resolver, s.token, "two")

    recs = await captured(bus, s.session_id, expect=2)
    assert [r.seq for r in recs] == [0, 1] and not any(r.void for r in recs)
    assert int(await redis_client.get(SEQ_KEY + s.session_id)) == 2


async def test_a_failed_call_overtaken_by_a_later_one_leaves_a_void_record(
    stack, bus, redis_client
):
    handler, engine, resolver = stack
    s = await new_session(redis_client, "numbering-void")
    first = asyncio.ensure_future(call(handler, resolver, s.token, "slow-bad"))
    assert await engine.started.get() == "slow-bad"
    later = asyncio.ensure_future(call(handler, resolver, s.token, "quick"))
    assert await engine.started.get() == "quick"
    await asyncio.sleep(0.05)  # both numbers taken
    engine.release("quick", answer(1))
    assert (await later).text == "answer 1"
    engine.release("slow-bad", fail)  # number 0 cannot be given back now
    with pytest.raises(UpstreamError):
        await first

    recs = sorted(await captured(bus, s.session_id, expect=2), key=lambda r: r.seq)
    assert [(r.seq, r.void) for r in recs] == [(0, True), (1, False)]
    assert "prompt too long" in recs[0].error and recs[0].output_ids == []
    calls = full_calls(recs)
    assert [c.seq for c in calls.calls] == [1] and calls.void == [0]
    assert assess(calls).intact  # a failed call is not a lost one


async def test_a_state_redis_refuses_after_the_record_is_committed_still_answers(
    stack, bus, redis_client
):
    handler, engine, resolver = stack
    s = await new_session(redis_client, "numbering-state")
    engine.release("one", answer(1))
    await call(handler, resolver, s.token, "one")
    failures = metrics.STATE_WRITE_FAILURES.labels("openai_chat")
    before = failures.value
    pending = asyncio.ensure_future(call(handler, resolver, s.token, "two"))
    await engine.started.get()
    await engine.started.get()
    # While the engine works, the state list becomes a string: Redis refuses the LPUSH
    await redis_client.set(f"{TITO_KEY}{s.session_id}:0", "not a list")
    engine.release("two", answer(2))
    turn = await pending
    assert turn.text == "answer 2"  # captured, so answered
    recs = await captured(bus, s.session_id, expect=2)
    assert [r.seq for r in recs] == [0, 1]
    assert failures.value == before + 1


async def test_when_capture_fails_the_state_is_taken_back_and_the_number_given_back(
    fresh_servers,
):
    nats_url, redis_url = fresh_servers
    bus, redis_client = await Bus.open(nats_url, "test-numbering"), aioredis.from_url(redis_url)
    try:
        async with handler_on(nats_url, redis_url, bus) as (handler, engine, resolver):
            s = await new_session(redis_client, "numbering-capfail")
            engine.release("one", answer(1))
            await call(handler, resolver, s.token, "one")
            await bus.js.delete_stream(S.STREAM_COMPLETIONS)
            engine.release("two", answer(2))
            with pytest.raises(UpstreamError) as caught:
                await call(handler, resolver, s.token, "two")
            assert caught.value.status == 503
            states = await redis_client.lrange(f"{TITO_KEY}{s.session_id}:0", 0, -1)
            assert len(states) == 1 and states[0].startswith(b"0:")  # the captured call's
            assert int(await redis_client.get(SEQ_KEY + s.session_id)) == 1
    finally:
        await bus.close()
        await redis_client.aclose()


async def test_a_counter_that_went_back_fails_the_call_instead_of_losing_it(
    stack, bus, redis_client
):
    """A Valkey failover can lose the counter's last INCRs (found by tests/cluster): the
    next call then takes a number an earlier call's record has, and JetStream dropped
    its record as a retried publish while the harness got its answer: a call missing
    from a trajectory marked intact. Now the call fails (503) and keeps the number
    taken, so the one after it is numbered past the collision and captured."""
    handler, engine, resolver = stack
    s = await new_session(redis_client, "numbering-back")
    engine.release("one", answer(1))
    await call(handler, resolver, s.token, "one")
    await redis_client.set(SEQ_KEY + s.session_id, 0)  # what the failover lost
    engine.release("two", answer(2))
    with pytest.raises(UpstreamError) as caught:  # before the fix: answered, not captured
        await call(handler, resolver, s.token, "two")
    assert caught.value.status == 503 and "already stored" in caught.value.message
    engine.release("three", answer(3))
    assert (await call(handler, resolver, s.token, "three")).text == "answer 3"
    recs = await captured(bus, s.session_id, expect=2)
    assert [(r.seq, r.output_ids) for r in recs] == [(0, [7, 1]), (1, [7, 3])]


async def test_a_refused_request_gives_back_the_number_its_lookup_took(stack, bus, redis_client):
    handler, engine, resolver = stack
    s = await new_session(redis_client, "numbering-refused")
    engine.release("one", answer(1))
    await call(handler, resolver, s.token, "one")
    refused = await resolver(s.token, True)  # its body then turned out malformed
    assert refused.seq == 1
    await handler.unused(refused, "openai_chat", "request body is not valid JSON")
    engine.release("two", answer(2))
    await call(handler, resolver, s.token, "two")
    recs = await captured(bus, s.session_id, expect=2)
    assert [r.seq for r in recs] == [0, 1] and not any(r.void for r in recs)


async def test_a_refused_request_overtaken_by_a_later_call_leaves_a_void_record(
    stack, bus, redis_client
):
    handler, engine, resolver = stack
    s = await new_session(redis_client, "numbering-refused-void")
    refused = await resolver(s.token, True)  # number 0
    engine.release("one", answer(1))
    await call(handler, resolver, s.token, "one")  # number 1
    await handler.unused(refused, "anthropic_messages", "messages: field required")
    recs = sorted(await captured(bus, s.session_id, expect=2), key=lambda r: r.seq)
    assert [(r.seq, r.void) for r in recs] == [(0, True), (1, False)]
    assert recs[0].error == "messages: field required"
    assert recs[0].protocol == "anthropic_messages"


async def test_a_call_after_running_is_refused_and_takes_no_number(stack, bus, redis_client):
    """A session's token dies as it leaves RUNNING (no grace window): a late call is not
    numbered, so the session's numbers stay exactly its captured calls."""
    handler, engine, resolver = stack
    reg = Registry(redis_client)
    s = await new_session(redis_client, "numbering-late")
    engine.release("one", answer(1))
    await call(handler, resolver, s.token, "one")
    assert (await reg.transition(s.session_id, SessionState.POSTRUN)).ok  # the harness exited
    assert await resolver(s.token, True) is None  # refused: a 401 in the caller's protocol
    assert int(await redis_client.get(S.key_call_seq(s.session_id))) == 1
    assert [r.seq for r in await captured(bus, s.session_id, expect=1)] == [0]


async def test_a_request_the_chat_template_rejects_is_a_400_and_gives_its_number_back(
    nats_url, redis_url, bus, redis_client
):
    """Token mode renders a first call's prompt while its lookup is out; the template's
    refusal (an image for a text-only template) is only raised once the call is made."""
    async with handler_on(nats_url, redis_url, bus, ChatTokenizer.load(tiny_model_dir())) as (
        handler,
        _engine,
        resolver,
    ):
        s = await new_session(redis_client, "numbering-template")
        image = Message(role="user", content=[ImagePart("data:image/png;base64,AAAA")])
        prepared = handler.prepare(
            Conversation(model="m", messages=[image]), "openai_chat", b"{}", {}
        )
        session = await resolver(s.token, True)
        assert session.seq == 0
        with pytest.raises(ProtocolError) as refused:
            await prepared(session, as_is)
        assert refused.value.status == 400 and "template rejects" in refused.value.message
        again = await resolver(s.token, True)
        assert again.seq == 0  # given back: no gap in the numbering
        await handler.unused(again, "openai_chat", "test done")


class BrokenConversation:
    """A conversation whose conversion fails: a bug in the proxy, not in the request."""

    model = "m"

    def to_openai_messages(self):
        raise RuntimeError("conversion bug")


async def test_a_request_whose_preparation_breaks_fails_and_gives_its_number_back(
    stack, redis_client
):
    handler, _engine, resolver = stack
    s = await new_session(redis_client, "numbering-broken")
    prepared = handler.prepare(BrokenConversation(), "openai_chat", b"{}", {})  # raises nothing
    session = await resolver(s.token, True)
    with pytest.raises(RuntimeError, match="conversion bug"):
        await prepared(session, as_is)
    again = await resolver(s.token, True)
    assert again.seq == 0
    await handler.unused(again, "openai_chat", "test done")


async def test_a_count_that_breaks_fails_and_gives_its_number_back(stack, redis_client):
    """count_tokens is numbered like a model call: one that cannot be described is not
    captured, and the next call reuses its number."""
    handler, _engine, resolver = stack
    s = await new_session(redis_client, "numbering-count-broken")
    session = await resolver(s.token, True)
    with pytest.raises(RuntimeError, match="conversion bug"):
        await handler.count(session, BrokenConversation(), "anthropic_messages", b"{}", {})
    again = await resolver(s.token, True)
    assert again.seq == 0
    await handler.unused(again, "openai_chat", "test done")
