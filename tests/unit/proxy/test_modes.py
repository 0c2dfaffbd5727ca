"""The upstream modes the completion handler delegates to (``proxy.modes``), without
servers: what each renders ahead, how each parses an answer, the aborted call's prompt."""

from __future__ import annotations

import asyncio

import pytest

from proxy.backends.base import Generation
from proxy.backends.base import ToolCall as EngineToolCall
from proxy.conversation import Conversation, Message, TextPart
from proxy.gate import WeightGate
from proxy.handler import CompletionHandler, _Request
from proxy.modes import MODES, ChatMode, TokenMode
from schemas import UpstreamMode
from services.common.tokenization import ChatTokenizer
from tests.unit.engine.tiny import tiny_model_dir


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.load(tiny_model_dir())


def request(*turns: tuple[str, str]) -> _Request:
    conv = Conversation(
        model="m", messages=[Message(role=r, content=[TextPart(t)]) for r, t in turns]
    )
    req = _Request(conv, "openai_chat", b"{}", {})
    req.describe()
    return req


def handler(mode: UpstreamMode, tok: ChatTokenizer | None) -> CompletionHandler:
    return CompletionHandler(
        publisher=None, store=None, backend=None, gate=WeightGate(), mode=mode,
        tokenizer=tok, default_max_tokens=16,
    )  # fmt: skip


def test_each_mode_is_its_own_object(tok):
    assert isinstance(handler(UpstreamMode.TOKEN, tok).upstream, TokenMode)
    assert isinstance(handler(UpstreamMode.CHAT, tok).upstream, ChatMode)
    assert isinstance(handler(UpstreamMode.CHAT, None).upstream, ChatMode)
    assert set(MODES) == set(UpstreamMode)
    with pytest.raises(ValueError, match="token mode needs the model's tokenizer"):
        handler(UpstreamMode.TOKEN, None)


def test_only_token_mode_renders_ahead_and_stops_on_the_templates_ids(tok):
    token, chat = TokenMode(None, tok), ChatMode(None, tok)
    first = request(("user", "Say hello."))
    token.render_ahead(first)
    assert first.prompt_ids == tok.render_ids(first.messages)
    again = request(("user", "Say hello."))
    chat.render_ahead(again)
    assert again.prompt_ids is None
    assert token.stop_ids == sorted(set(tok.eos_token_ids)) and chat.stop_ids == []


def test_an_aborted_calls_prompt_is_the_proxys_own_in_token_mode_only(tok):
    req = request(("user", "Say hello."))
    plan = asyncio.run(TokenMode(None, tok).aborted_plan(req, [], "s-0000", 0))
    assert plan.prompt_ids == tok.render_ids(req.messages)
    assert asyncio.run(ChatMode(None, tok).aborted_plan(req, [], "s-0000", 0)).prompt_ids == []


def test_chat_mode_keeps_the_engines_tool_call_ids_and_parses_nothing_itself():
    gen = Generation(
        prompt_ids=[1], output_ids=[2], output_logprobs=[0.0], finish_reason="stop",
        text="hi", reasoning=None, tool_calls=[EngineToolCall(id="c1", name="f", arguments="{}")],
    )  # fmt: skip
    turn, health = ChatMode(None, None).turn(gen, None)
    assert health is None  # no tools offered, no tokenizer to read the output with
    assert (turn.text, turn.reasoning, turn.finish_reason) == ("hi", "", "tool_calls")
    assert [(c.id, c.name, c.arguments) for c in turn.tool_calls] == [("c1", "f", "{}")]
