"""The normalized conversation: OpenAI-shaped export, system handling, errors per protocol."""

from __future__ import annotations

import msgspec
import pytest

from proxy.conversation import (
    Conversation,
    ImagePart,
    Message,
    ReasoningPart,
    TextPart,
    ToolCall,
    ToolSpec,
    fill_tool_names,
    join_system,
    strip_billing_header,
)
from proxy.errors import ErrorKind, ProtocolError, UpstreamError
from proxy.protocols import PROTOCOLS, anthropic_messages, gemini, openai_chat
from tests.unit.protocols.golden import cases


def by_name(name: str):
    return next(c for c in cases() if str(c) == name)


def test_billing_header_line_is_stripped_and_other_lines_kept() -> None:
    text = "x-anthropic-billing-header: cc_version=2.1.37; cch=1;\nYou are Claude Code."
    assert strip_billing_header(text) == "You are Claude Code."
    assert (
        join_system(["x-anthropic-billing-header: cc_version=2.1.38; cch=2;", "A", "", "B"])
        == "A\n\nB"
    )
    assert strip_billing_header("no header here") == "no header here"


def test_two_claude_code_calls_differing_only_in_billing_header_normalize_equal() -> None:
    case = by_name("anthropic_messages/claude_code_first_call")
    first = case.request
    second = msgspec.json.decode(msgspec.json.encode(first))
    second["system"][0]["text"] = (
        "x-anthropic-billing-header: cc_version=2.1.37.zzz; cc_entrypoint=sdk-cli; cch=99999;"
    )
    assert anthropic_messages.parse_request(first, {}, {}) == anthropic_messages.parse_request(
        second, {}, {}
    )


def test_openai_messages_export_of_a_tool_round_trip() -> None:
    conv = by_name("anthropic_messages/claude_code_tool_result_nonstream").parse()
    msgs = conv.to_openai_messages()
    assert msgs[0] == {"role": "system", "content": conv.system}
    assert "billing" not in conv.system
    assistant = msgs[2]
    assert assistant == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I'll write the file with Bash.",
        "tool_calls": [
            {
                "id": "toolu_01A",
                "type": "function",
                "function": {
                    "name": "Bash",
                    "arguments": '{"command": "echo proof > proof.txt", "description": "Write proof to proof.txt"}',
                },
            }
        ],
    }
    assert msgs[3] == {"role": "tool", "content": "", "tool_call_id": "toolu_01A", "name": "Bash"}
    assert (
        msgs[4]["role"] == "user" and msgs[5]["role"] == "system"
    )  # in-conversation system kept in place


def test_openai_content_joins_text_and_lists_images() -> None:
    conv = Conversation(
        messages=[
            Message(role="user", content=[TextPart("a"), TextPart("b")]),
            Message(role="user", content=[TextPart("look"), ImagePart("data:image/png;base64,AA")]),
            Message(role="assistant", content=[ReasoningPart("hm"), TextPart("ok")]),
        ]
    )
    user1, user2, assistant = conv.to_openai_messages()
    assert user1["content"] == "a\nb"
    assert user2["content"] == [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
    ]
    assert assistant == {"role": "assistant", "content": "ok", "reasoning_content": "hm"}


def test_openai_tools_export_skips_hosted_tools_and_offers_custom_tools_as_input_string() -> None:
    conv = by_name("openai_responses/codex_first_call").parse()
    tools = conv.to_openai_tools()
    assert [t["function"]["name"] for t in tools] == ["exec_command", "apply_patch", "spawn_agent"]
    assert tools[1]["function"]["parameters"]["properties"] == {"input": {"type": "string"}}
    assert conv.tool_named("spawn_agent").namespace == "multi_agent"  # type: ignore[union-attr]


def test_tool_results_get_the_name_of_their_call() -> None:
    msgs = fill_tool_names(
        [
            Message(role="assistant", tool_calls=[ToolCall("c1", "ls", "{}")]),
            Message(role="tool", tool_call_id="c1"),
            Message(role="tool", tool_call_id="unknown"),
        ]
    )
    assert [m.name for m in msgs] == ["", "ls", ""]


def test_normalized_conversation_round_trips_through_msgspec() -> None:
    for case in cases():
        conv = case.parse()
        assert msgspec.json.decode(msgspec.json.encode(conv), type=Conversation) == conv


def test_gemini_parameters_schema_becomes_json_schema() -> None:
    conv = by_name("gemini/router_json_schema_nonstream").parse()
    assert conv.tools[0] == ToolSpec(
        name="glob",
        description="Find files",
        parameters={
            "type": "object",
            "properties": {"pattern": {"type": "string"}, "limit": {"type": ["integer", "null"]}},
            "required": ["pattern"],
        },
    )


@pytest.mark.parametrize("spec", PROTOCOLS, ids=lambda p: p.name)
@pytest.mark.parametrize("kind", list(ErrorKind))
def test_every_error_kind_has_a_protocol_shaped_body(spec, kind: ErrorKind) -> None:
    status, body = spec.error_body(kind, "boom", None)
    assert 400 <= status < 600
    assert "boom" in str(body)
    assert isinstance(body.get("error"), dict)


def test_error_statuses_follow_each_protocols_conventions() -> None:
    assert openai_chat.openai_error_body(ErrorKind.CONTEXT_LENGTH, "too long", None) == (
        400,
        {
            "error": {
                "message": "too long",
                "type": "invalid_request_error",
                "param": None,
                "code": "context_length_exceeded",
            }
        },
    )
    assert anthropic_messages.error_body(ErrorKind.OVERLOADED, "busy", None)[0] == 529
    status, body = anthropic_messages.error_body(
        ErrorKind.CONTEXT_LENGTH, "9000 tokens > 8192 maximum", None
    )
    assert (status, body["error"]["message"]) == (
        400,
        "prompt is too long: 9000 tokens > 8192 maximum",
    )
    assert gemini.error_body(ErrorKind.UNAVAILABLE, "down", None) == (
        503,
        {"error": {"code": 503, "message": "down", "status": "UNAVAILABLE"}},
    )


def test_error_classes_carry_kind_and_status() -> None:
    assert ProtocolError(413, "big").kind is ErrorKind.TOO_LARGE
    assert ProtocolError(400, "bad", "messages").param == "messages"
    assert UpstreamError(500, "ctx", "context_length").kind is ErrorKind.CONTEXT_LENGTH
    with pytest.raises(ValueError):
        UpstreamError(500, "x", "no_such_kind")


def test_openai_chat_template_kwargs_reach_the_conversation_and_a_bad_one_is_a_400() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": False},
        "reasoning_effort": "low",
    }
    conv = openai_chat.parse_request(body, {}, {})
    assert conv.template_kwargs == {"enable_thinking": False}
    assert conv.reasoning is not None and conv.reasoning.effort == "low"
    with pytest.raises(ProtocolError) as err:
        openai_chat.parse_request({**body, "chat_template_kwargs": "enable_thinking"}, {}, {})
    assert err.value.status == 400 and "chat_template_kwargs must be an object" in str(err.value)


@pytest.mark.parametrize(
    ("thinking", "enabled"),
    [({"type": "disabled"}, False), ({"type": "enabled", "budget_tokens": 2048}, True)],
)
def test_anthropic_thinking_is_the_conversations_reasoning(thinking, enabled) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    conv = anthropic_messages.parse_request({**body, "thinking": thinking}, {}, {})
    assert conv.reasoning is not None and conv.reasoning.enabled is enabled


def test_gemini_thinking_budget_zero_turns_reasoning_off() -> None:
    body = {
        "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
        "generationConfig": {"thinkingConfig": {"thinkingBudget": 0}},
    }
    conv = gemini.parse_request(body, {"model": "m:generateContent"}, {})
    assert conv.reasoning is not None and conv.reasoning.enabled is False
