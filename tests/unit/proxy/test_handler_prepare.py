"""What ``CompletionHandler.prepare`` does before a call's session is known (no servers:
preparing touches none of them)."""

from __future__ import annotations

import msgspec
import pytest

from proxy.conversation import Conversation, Message, Reasoning, TextPart, ToolSpec
from proxy.gate import WeightGate
from proxy.handler import CompletionHandler
from proxy.modes import RENDER_AHEAD_MAX_BYTES
from schemas import UpstreamMode
from services.common.tokenization import ChatTokenizer
from tests.unit.engine.tiny import tiny_model_dir


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.load(tiny_model_dir())


def handler(tok: ChatTokenizer, renders: list) -> CompletionHandler:
    counted = ChatTokenizer(tok.tokenizer, tok.chat_template, tok.special_tokens, tok.eos_token_ids)
    render_ids = counted.render_ids
    counted.render_ids = lambda *a, **k: renders.append(1) or render_ids(*a, **k)
    return CompletionHandler(
        publisher=None, store=None, backend=None, gate=WeightGate(), mode=UpstreamMode.TOKEN,
        tokenizer=counted, default_max_tokens=16,
    )  # fmt: skip


def conv(*turns: tuple[str, str]) -> Conversation:
    messages = [Message(role=role, content=[TextPart(text)]) for role, text in turns]
    return Conversation(model="m", messages=messages)


def test_a_short_first_call_is_rendered_while_its_lookup_is_out(tok):
    renders: list = []
    first = conv(("system", "Be brief."), ("user", "Say hello."))
    call = handler(tok, renders).prepare(first, "openai_chat", b"{}", {})
    assert renders == [1]
    prepared = call.args[0]
    assert prepared.prompt_ids == tok.render_ids(first.to_openai_messages())


def test_a_long_request_or_one_that_may_continue_a_state_is_not(tok):
    renders: list = []
    h = handler(tok, renders)
    first = conv(("user", "Say hello."))
    h.prepare(first, "openai_chat", b"x" * (RENDER_AHEAD_MAX_BYTES + 1), {})
    # an unknown token must not cost a long render: it waits for the session
    later = conv(("user", "Say hello."), ("assistant", "Hello."), ("user", "Again."))
    h.prepare(later, "openai_chat", b"{}", {})  # its prompt depends on the session's states
    assert renders == []


def prepared_ids(h: CompletionHandler, c: Conversation) -> list[int]:
    return h.prepare(c, "openai_chat", b"{}", {}).args[0].prompt_ids


def test_an_identical_first_call_reuses_the_rendered_prompt_ids(tok):
    renders: list = []
    h = handler(tok, renders)
    first = conv(("system", "Be brief."), ("user", "Say hello."))
    ids = prepared_ids(h, first)
    again = prepared_ids(h, conv(("system", "Be brief."), ("user", "Say hello.")))
    assert renders == [1]
    assert again == ids == tok.render_ids(first.to_openai_messages())
    again.append(0)  # each call gets its own list: the cached ids stay as rendered
    assert prepared_ids(h, first) == ids
    assert renders == [1]


def test_a_first_call_that_differs_in_anything_rendered_is_rendered(tok):
    renders: list = []
    h = handler(tok, renders)
    prepared_ids(h, conv(("system", "Be brief."), ("user", "Say hello.")))
    other = conv(("system", "Be brief."), ("user", "Say hello!"))
    with_tools = msgspec.structs.replace(
        conv(("system", "Be brief."), ("user", "Say hello.")),
        tools=[ToolSpec(name="f", parameters={"type": "object"})],
    )
    for c in (other, with_tools):
        assert prepared_ids(h, c) == tok.render_ids(c.to_openai_messages(), c.to_openai_tools())
    assert renders == [1, 1, 1]


def test_a_template_that_writes_the_date_is_rendered_every_time(tok):
    renders: list = []
    dated = ChatTokenizer(
        tok.tokenizer, "{{ strftime_now('%d %b %Y') }}" + tok.chat_template,
        tok.special_tokens, tok.eos_token_ids,
    )  # fmt: skip
    render_ids = dated.render_ids
    dated.render_ids = lambda *a, **k: renders.append(1) or render_ids(*a, **k)
    h = CompletionHandler(
        publisher=None, store=None, backend=None, gate=WeightGate(), mode=UpstreamMode.TOKEN,
        tokenizer=dated, default_max_tokens=16,
    )  # fmt: skip
    first = conv(("user", "Say hello."))
    assert prepared_ids(h, first) == prepared_ids(h, first)
    assert renders == [1, 1]


def qwen3_handler(tok: ChatTokenizer, renders: list) -> CompletionHandler:
    """The tiny vocabulary under Qwen3's official template (the family: enable_thinking)."""
    from importlib import resources

    from services.common.tokenization.families import FAMILIES

    template = resources.files("trl").joinpath("chat_templates/qwen3.jinja").read_text("utf-8")
    qwen = ChatTokenizer(
        tok.tokenizer, template, tok.special_tokens, tok.eos_token_ids, family=FAMILIES["qwen3"]
    )
    render_ids = qwen.render_ids
    qwen.render_ids = lambda *a, **k: renders.append(k) or render_ids(*a, **k)
    return CompletionHandler(
        publisher=None, store=None, backend=None, gate=WeightGate(), mode=UpstreamMode.TOKEN,
        tokenizer=qwen, default_max_tokens=16,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("reasoning", "explicit", "variables"),
    [
        (None, {}, {}),
        (Reasoning(enabled=False), {}, {"enable_thinking": False}),  # Anthropic / Gemini off
        (Reasoning(effort="none"), {}, {"enable_thinking": False}),  # OpenAI reasoning_effort
        (None, {"enable_thinking": False}, {"enable_thinking": False}),  # chat_template_kwargs
        (Reasoning(enabled=True), {"enable_thinking": False}, {"enable_thinking": False}),
    ],
)
def test_a_requests_reasoning_settings_reach_the_render(tok, reasoning, explicit, variables):
    renders: list = []
    h = qwen3_handler(tok, renders)
    c = msgspec.structs.replace(
        conv(("user", "Say hello.")), reasoning=reasoning, template_kwargs=explicit
    )
    ids = prepared_ids(h, c)
    assert renders == [variables]
    text = h.tok.decode(ids, skip_special_tokens=False)
    thinking_off = variables.get("enable_thinking") is False
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == thinking_off


def test_the_same_messages_under_other_variables_are_other_prompts(tok):
    renders: list = []
    h = qwen3_handler(tok, renders)
    on, off = conv(("user", "Say hello.")), conv(("user", "Say hello."))
    off = msgspec.structs.replace(off, template_kwargs={"enable_thinking": False})
    assert prepared_ids(h, on) != prepared_ids(h, off)  # not one cache entry for both
    assert prepared_ids(h, off) == prepared_ids(h, off) and len(renders) == 2
