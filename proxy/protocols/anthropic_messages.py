"""Anthropic Messages: ``POST /v1/messages`` (``?beta=true``) and ``/v1/messages/count_tokens``
(Claude Code, pi).

Stream grammar (every event has an ``event:`` line; clients ignore data-only events):
``message_start``, per content block ``content_block_start`` / ``content_block_delta``
(thinking_delta, text_delta, input_json_delta) / ``content_block_stop``, then
``message_delta`` (stop_reason, output usage) and ``message_stop``. Keep-alives are
``ping`` events, as Anthropic's own servers send.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import orjson

from proxy.conversation import (
    AssistantTurn,
    Conversation,
    Reasoning,
    Sampling,
    ToolChoice,
    ToolSpec,
    field_order,
    fill_tool_names,
)
from proxy.errors import DEFAULT_STATUS, ErrorKind
from proxy.protocols.anthropic_input import parse_messages, system_texts
from proxy.protocols.base import (
    Endpoint,
    ProtocolSpec,
    ReplyIds,
    Route,
    as_dict,
    bad,
    json_object,
    opt_bool,
    opt_count,
    opt_dict,
    opt_int,
    opt_list,
    opt_number,
    opt_str,
    req_str,
    stop_list,
)
from proxy.sse import ANTHROPIC_PING, SseEvent, encode

NAME = "anthropic_messages"
STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "max_tokens"}

# ---------------------------------------------------------------- request


def parse_request(
    body: dict[str, Any], path_params: Mapping[str, Any], query: Mapping[str, str]
) -> Conversation:
    raw = body.get("messages")
    if not isinstance(raw, list):
        raise bad("messages: field required (an array)", "messages")
    system, messages, dropped = parse_messages(raw, system_texts(body.get("system")))
    metadata: dict[str, Any] = {}
    for key in ("context_management", "thinking", "output_config"):
        if body.get(key) is not None:
            metadata[key] = body[key]
    if dropped:
        metadata["dropped_blocks"] = dropped
    return Conversation(
        model=opt_str(body, "model") or "",
        system=system,
        messages=fill_tool_names(messages),
        tools=parse_tools(opt_list(body, "tools")),
        tool_choice=parse_tool_choice(opt_dict(body, "tool_choice")),
        sampling=Sampling(
            temperature=opt_number(body, "temperature"),
            top_p=opt_number(body, "top_p"),
            top_k=opt_int(body, "top_k"),
            max_tokens=opt_count(body, "max_tokens"),
            stop=stop_list(body.get("stop_sequences"), "stop_sequences"),
        ),
        reasoning=parse_thinking(opt_dict(body, "thinking"), opt_dict(body, "output_config")),
        stream=bool(opt_bool(body, "stream")),
        metadata=metadata,
    )


def parse_tools(raw: list[Any]) -> list[ToolSpec]:
    """Client tools (no type, or type "custom") reach the model, deferred ones too (we have
    no server-side tool search); server tools (web_search_…, tool_search_…) are kind other."""
    tools = []
    for i, item in enumerate(raw):
        t, at = as_dict(item, f"tools[{i}]"), f"tools[{i}]."
        if t.get("type") in (None, "custom") and "input_schema" in t:
            tools.append(
                ToolSpec(
                    name=req_str(t, "name", at),
                    description=opt_str(t, "description", at) or "",
                    parameters=opt_dict(t, "input_schema", at),
                    deferred=bool(t.get("defer_loading")),
                    field_order=field_order(t, "input_schema"),
                )
            )
        else:
            tools.append(
                ToolSpec(name=str(t.get("name") or t.get("type") or "tool"), kind="other", raw=t)
            )
    return tools


def parse_tool_choice(tc: dict[str, Any]) -> ToolChoice | None:
    kind = tc.get("type")
    modes = {"auto": "auto", "any": "required", "none": "none"}
    if isinstance(kind, str) and kind in modes:
        return ToolChoice(mode=modes[kind])  # type: ignore[arg-type]
    if kind == "tool":
        return ToolChoice(mode="named", name=req_str(tc, "name", "tool_choice."))
    if tc:
        raise bad("tool_choice.type must be auto, any, tool or none", "tool_choice.type")
    return None


def parse_thinking(thinking: dict[str, Any], output_config: dict[str, Any]) -> Reasoning | None:
    kind = thinking.get("type")
    effort = output_config.get("effort") if isinstance(output_config.get("effort"), str) else None
    if kind in ("enabled", "adaptive"):
        return Reasoning(
            enabled=True,
            effort=effort,
            budget_tokens=opt_int(thinking, "budget_tokens", "thinking."),
        )
    if kind == "disabled":
        return Reasoning(enabled=False)
    return Reasoning(effort=effort) if effort else None


# ---------------------------------------------------------------- response


def content_blocks(turn: AssistantTurn, ids: ReplyIds) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if turn.reasoning:
        blocks.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.text:
        blocks.append({"type": "text", "text": turn.text})
    for i, call in enumerate(turn.tool_calls):
        call_id = ids.call_id("toolu_", i, call.id)
        blocks.append(
            {
                "type": "tool_use",
                "id": call_id,
                "name": call.name,
                "input": json_object(call.arguments),
            }
        )
    return blocks


def usage_body(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_body(
    turn: AssistantTurn, conv: Conversation, ids: ReplyIds, content: list[Any], final: bool
) -> dict[str, Any]:
    u = turn.usage
    return {
        "id": f"msg_{ids.token}",
        "type": "message",
        "role": "assistant",
        "model": conv.model,
        "content": content,
        "stop_reason": STOP[turn.finish_reason] if final else None,
        "stop_sequence": None,
        "usage": usage_body(u.prompt_tokens, u.completion_tokens if final else 0),
    }


def render_response(turn: AssistantTurn, conv: Conversation, ids: ReplyIds) -> dict[str, Any]:
    return message_body(turn, conv, ids, content_blocks(turn, ids), final=True)


def render_stream(turn: AssistantTurn, conv: Conversation, ids: ReplyIds) -> Iterator[SseEvent]:
    yield _event("message_start", message=message_body(turn, conv, ids, [], final=False))
    for index, block in enumerate(content_blocks(turn, ids)):
        yield from block_events(index, block)
    delta = {"stop_reason": STOP[turn.finish_reason], "stop_sequence": None}
    usage = usage_body(turn.usage.prompt_tokens, turn.usage.completion_tokens)
    yield _event("message_delta", delta=delta, usage=usage)
    yield _event("message_stop")


def block_events(index: int, block: dict[str, Any]) -> Iterator[SseEvent]:
    kind = block["type"]
    if kind == "thinking":
        start, delta = (
            {**block, "thinking": ""},
            {"type": "thinking_delta", "thinking": block["thinking"]},
        )
    elif kind == "text":
        start, delta = {**block, "text": ""}, {"type": "text_delta", "text": block["text"]}
    else:
        partial = orjson.dumps(block["input"]).decode()
        start, delta = {**block, "input": {}}, {"type": "input_json_delta", "partial_json": partial}
    yield _event("content_block_start", index=index, content_block=start)
    yield _event("content_block_delta", index=index, delta=delta)
    yield _event("content_block_stop", index=index)


def _event(name: str, **fields: Any) -> SseEvent:
    return SseEvent({"type": name, **fields}, name)


def render_stream_error(
    kind: ErrorKind, message: str, conv: Conversation, ids: ReplyIds
) -> Iterator[SseEvent]:
    yield SseEvent(error_body(kind, message, None)[1], "error")


_PING = encode(ANTHROPIC_PING)


def keepalive(conv: Conversation, ids: ReplyIds) -> bytes:
    return _PING


def render_count_tokens(n: int) -> dict[str, Any]:
    return {"input_tokens": n}


# ---------------------------------------------------------------- errors

_ERRORS: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorKind.UNAUTHORIZED: (401, "authentication_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.TOO_LARGE: (413, "request_too_large"),
    ErrorKind.CONTEXT_LENGTH: (400, "invalid_request_error"),
    ErrorKind.OVERLOADED: (529, "overloaded_error"),
    ErrorKind.UNAVAILABLE: (529, "overloaded_error"),
    ErrorKind.CAPTURE_FAILED: (DEFAULT_STATUS[ErrorKind.CAPTURE_FAILED], "api_error"),
    ErrorKind.INTERNAL: (500, "api_error"),
}


def error_body(kind: ErrorKind, message: str, param: str | None) -> tuple[int, dict[str, Any]]:
    status, etype = _ERRORS[kind]
    if kind is ErrorKind.CONTEXT_LENGTH and "prompt is too long" not in message:
        message = f"prompt is too long: {message}"  # the wording Claude Code looks for
    return status, {"type": "error", "error": {"type": etype, "message": message}}


PROTOCOL = ProtocolSpec(
    name=NAME,
    routes=(
        Route("POST", "/v1/messages", Endpoint.GENERATE),
        Route("POST", "/v1/messages/count_tokens", Endpoint.COUNT_TOKENS),
    ),
    error_body=error_body,
    parse_request=parse_request,
    render_response=render_response,
    render_stream=render_stream,
    render_stream_error=render_stream_error,
    keepalive=keepalive,
    render_count_tokens=render_count_tokens,
)
