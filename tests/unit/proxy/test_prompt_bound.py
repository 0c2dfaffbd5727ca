"""A prompt whose text cannot fit the context is refused before it is converted,
rendered or tokenized (issue 33): the engine's context-length 400, in the caller's
protocol, for a model call and a count_tokens call alike. A long call that may fit is
planned off the event loop, its aborted record too; a large request's memory is given
back once it is done. No servers."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import orjson
import pytest

from proxy.app import SessionInfo, error_response
from proxy.backends.base import Capabilities
from proxy.config import ProxyConfig
from proxy.conversation import Conversation, Message, TextPart
from proxy.errors import ErrorKind, PromptTooLong
from proxy.gate import WeightGate
from proxy.handler import CompletionHandler, _Request
from proxy.main import context_tokens
from proxy.memory import TRIM_AFTER_BYTES, MemoryGiveBack
from proxy.modes import PLAN_OFF_LOOP_BYTES
from proxy.promptbound import PromptBound
from proxy.protocols import PROTOCOLS
from schemas import UpstreamMode
from services.common.tokenization import ChatTokenizer
from tests.unit.engine.tiny import tiny_model_dir

CONTEXT = 32768
SESSION = SessionInfo(session_id="s-0000")  # no number taken: nothing to give back


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.load(tiny_model_dir())


def handler(tok: ChatTokenizer, renders: list, context: int | None = CONTEXT, **kw):
    """Token mode over ``tok``; each render's thread is appended to ``renders``."""
    counted = ChatTokenizer(tok.tokenizer, tok.chat_template, tok.special_tokens, tok.eos_token_ids)
    render_ids = counted.render_ids
    counted.render_ids = lambda *a, **k: (
        renders.append(threading.get_ident()) or render_ids(*a, **k)
    )
    return CompletionHandler(
        publisher=None, store=None, backend=None, gate=WeightGate(), mode=UpstreamMode.TOKEN,
        tokenizer=counted, default_max_tokens=16, context_tokens=context, **kw,
    )  # fmt: skip


def conv(*turns: tuple[str, str], system: str = "") -> Conversation:
    messages = [Message(role=role, content=[TextPart(text)]) for role, text in turns]
    return Conversation(model="m", system=system, messages=messages)


def raw_of(c: Conversation) -> bytes:
    return orjson.dumps({"messages": c.to_openai_messages()})


def test_a_prompt_that_cannot_fit_is_refused_before_anything_is_rendered(tok):
    renders: list = []
    h = handler(tok, renders)
    over = h.bound.refused_bytes  # 32769 tokens of the tiny vocabulary's longest (16 bytes)
    assert over == (CONTEXT + 1) * 16
    big = conv(("user", "start"), ("assistant", "ok"), ("user", "x" * over))
    call = h.prepare(big, "openai_chat", b"x" * over, {})
    request = call.args[0]
    assert isinstance(request.broken, PromptTooLong)
    assert request.messages == [] and request.normalized == b"null"  # not even converted
    with pytest.raises(PromptTooLong) as refused:
        asyncio.run(call(SESSION, lambda turn: turn))
    assert (refused.value.status, refused.value.kind) == (400, ErrorKind.CONTEXT_LENGTH)
    assert refused.value.message == (
        f"prompt has at least {CONTEXT + 1} tokens; the context limit is {CONTEXT}"
    )
    assert renders == []


def test_what_counts_is_the_text_every_template_keeps(tok):
    h = handler(tok, [])
    half = "y" * (h.bound.refused_bytes // 2)
    # system + user + tool texts add up; an assistant's (its reasoning may be dropped,
    # token mode sends what was sampled) does not
    over = conv(("user", half), ("assistant", "ok"), ("tool", half), system="z" * 16)
    assert isinstance(h.bound.refusal(over), PromptTooLong)
    assistant = conv(("user", "hi"), ("assistant", half * 4), ("user", "again"))
    assert h.bound.refusal(assistant) is None
    just_under = conv(("user", "x" * (h.bound.refused_bytes - 1)))
    assert h.bound.refusal(just_under) is None
    # non-ASCII text counts its UTF-8 bytes (the tiny vocabulary has no normalizer)
    wide = conv(("user", "漢" * (h.bound.refused_bytes // 3 + 1)))
    assert isinstance(h.bound.refusal(wide), PromptTooLong)


def test_count_tokens_is_refused_alike(tok):
    renders: list = []
    h = handler(tok, renders)
    big = conv(("user", "x" * h.bound.refused_bytes))
    with pytest.raises(PromptTooLong):
        asyncio.run(h.count(SESSION, big, "anthropic_messages", b"{}", {}))
    assert renders == []


def test_each_protocol_answers_it_as_its_context_length_error():
    err = PromptTooLong("prompt has at least 40000 tokens; the context limit is 32768")
    for spec in PROTOCOLS:
        reply = error_response(spec, err.kind, err.message)
        body = orjson.loads(reply.body)
        assert reply.status == 400, (spec.name, body)
        assert "the context limit is 32768" in orjson.dumps(body).decode(), (spec.name, body)
    openai = next(s for s in PROTOCOLS if s.name == "openai_chat")
    assert orjson.loads(error_response(openai, err.kind, err.message).body)["error"]["code"] == (
        "context_length_exceeded"
    )


def test_the_context_is_configured_else_the_engines_else_the_models(tok):
    caps = Capabilities(server="sglang", base_url="u", context_length=4096)
    assert context_tokens(ProxyConfig(context_tokens=1000), caps, tok) == 1000
    assert context_tokens(ProxyConfig(), caps, tok) == 4096
    assert context_tokens(ProxyConfig(), None, tok) == tok.context_tokens == CONTEXT
    assert context_tokens(ProxyConfig(), None, None) is None
    assert PromptBound.of(tok, context_tokens(ProxyConfig(context_tokens=0), caps, tok)) is None
    assert handler(tok, [], context=None).bound is None


def test_a_long_count_and_an_aborted_calls_plan_run_off_the_event_loop(tok):
    renders: list = []
    h = handler(tok, renders)
    long = conv(("user", "word " * (PLAN_OFF_LOOP_BYTES // 4)))
    raw = raw_of(long)
    assert len(raw) > PLAN_OFF_LOOP_BYTES

    class Number:  # the call's number, taken and committed
        def __await__(self):
            return asyncio.sleep(0, 1).__await__()

        async def commit(self, record) -> None:
            self.record = record

    h.numbers = SimpleNamespace(of=lambda _sid, _seq: Number())

    async def both() -> tuple[int, list[int]]:
        n = await h.count(SESSION, long, "anthropic_messages", raw, {})
        request = _Request(long, "openai_chat", raw, {})
        request.describe()
        plan = await h.upstream.aborted_plan(request, [], "s-0000", 0)
        return n, plan.prompt_ids

    main = threading.get_ident()
    n, ids = asyncio.run(both())
    assert n == len(ids) > 1000
    assert len(renders) == 2 and main not in renders, renders
    short = conv(("user", "hi"))  # a short one stays inline: cheaper than a thread
    asyncio.run(h.count(SESSION, short, "anthropic_messages", raw_of(short), {}))
    assert renders[-1] == main


async def until(done, timeout: float = 30.0) -> None:
    """Wait for ``done()`` (no wall-clock margin: a loaded machine only makes it later)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not done():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.005)


def test_memory_is_given_back_after_a_large_request_only():
    trims: list[int] = []
    gate = threading.Event()

    def trim(pad: int) -> int:
        gate.wait(30)
        trims.append(pad)
        return 1

    memory = MemoryGiveBack(trim, delay_s=0.01)

    async def scenario() -> None:
        memory.after(TRIM_AFTER_BYTES - 1)  # a short one: nothing
        assert not memory._scheduled
        gate.set()
        memory.after(TRIM_AFTER_BYTES)
        memory.after(TRIM_AFTER_BYTES)  # before it starts: one trim for both
        await until(lambda: memory.trims == 1 and not memory._running)
        assert not memory._scheduled
        gate.clear()
        memory.after(TRIM_AFTER_BYTES)
        await until(lambda: memory._running)
        memory.after(TRIM_AFTER_BYTES)  # under way: one more after it
        gate.set()
        await until(lambda: memory.trims == 3 and not memory._running)
        assert not memory._scheduled

    asyncio.run(scenario())
    assert trims == [0, 0, 0]


def test_a_refused_large_call_gives_its_memory_back(tok):
    trims: list[int] = []
    h = handler(tok, [], memory=MemoryGiveBack(lambda pad: trims.append(pad) or 1, delay_s=0))
    over = "x" * h.bound.refused_bytes
    raw = b"x" * TRIM_AFTER_BYTES

    async def refused() -> None:
        with pytest.raises(PromptTooLong):
            await h.prepare(conv(("user", over)), "openai_chat", raw, {})(SESSION, lambda t: t)
        await until(lambda: h.memory.trims == 1)

    asyncio.run(refused())
    assert trims == [0] and h.memory.trims == 1
