"""OpenAI Chat Completions: ``POST /v1/chat/completions`` (Qwen Code, opencode, pi).

Stream grammar: a role chunk, reasoning/content/tool-call deltas (each tool call: a chunk
with id, type and name, then one with its arguments), a chunk with ``finish_reason``, a
usage chunk with empty ``choices`` when ``stream_options.include_usage``, then ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from proxy.conversation import (
    CUSTOM_TOOL_PARAMETERS,
    AssistantTurn,
    Conversation,
    ImagePart,
    Message,
    Part,
    Reasoning,
    ReasoningPart,
    Sampling,
    TextPart,
    ToolCall,
    ToolChoice,
    ToolSpec,
    field_order,
    fill_tool_names,
    join_system,
    openai_tool_call,
    text_of,
)
from proxy.errors import DEFAULT_STATUS, ErrorKind
from proxy.protocols.base import (
    Endpoint,
    ProtocolSpec,
    ReplyIds,
    Route,
    as_dict,
    bad,
    json_text,
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
from proxy.sse import DONE, KEEPALIVE_COMMENT, SseEvent

NAME = "openai_chat"
FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "abort": "length"}
SYSTEM_ROLES = ("system", "developer")
# Parts the user means the model to read that the prompt cannot hold: why, and what to
# send. A 400 naming the field, never a part silently left out (the model would answer
# about a file or a sound it never saw).
UNREADABLE_PARTS = {
    "file": (
        "Polar has no files API and the prompt holds text and images only",
        "send the file's text as a text part",
    ),
    "input_audio": ("the prompt holds text and images only", "send a transcript as a text part"),
}

# ---------------------------------------------------------------- request


def parse_request(
    body: dict[str, Any], path_params: Mapping[str, Any], query: Mapping[str, str]
) -> Conversation:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty array", "messages")
    system, messages = parse_messages(raw)
    stream_options = opt_dict(body, "stream_options")
    return Conversation(
        model=opt_str(body, "model") or "",
        system=system,
        messages=fill_tool_names(messages),
        tools=parse_tools(opt_list(body, "tools")),
        tool_choice=parse_tool_choice(body.get("tool_choice")),
        sampling=parse_sampling(body),
        reasoning=Reasoning(effort=e) if (e := opt_str(body, "reasoning_effort")) else None,
        response_format=opt_dict(body, "response_format") or None,
        template_kwargs=opt_dict(body, "chat_template_kwargs"),
        stream=bool(opt_bool(body, "stream")),
        metadata={"include_usage": True}
        if opt_bool(stream_options, "include_usage", "stream_options.")
        else {},
    )


def parse_sampling(body: dict[str, Any]) -> Sampling:
    max_tokens = opt_count(body, "max_completion_tokens")
    return Sampling(
        temperature=opt_number(body, "temperature"),
        top_p=opt_number(body, "top_p"),
        top_k=opt_int(body, "top_k"),
        max_tokens=max_tokens if max_tokens is not None else opt_count(body, "max_tokens"),
        stop=stop_list(body.get("stop"), "stop"),
        seed=opt_int(body, "seed"),
    )


def parse_messages(raw: list[Any]) -> tuple[str, list[Message]]:
    """Leading system/developer messages become the system text; later ones stay in place."""
    system_texts: list[str] = []
    messages: list[Message] = []
    for i, item in enumerate(raw):
        m = as_dict(item, f"messages[{i}]")
        role = req_str(m, "role", f"messages[{i}].")
        if role in SYSTEM_ROLES:
            text = text_of(parse_content(m.get("content"), f"messages[{i}].content"))
            if messages:
                messages.append(Message(role="system", content=[TextPart(join_system([text]))]))
            else:
                system_texts.append(text)
            continue
        messages.append(parse_message(m, role, f"messages[{i}]."))
    return join_system(system_texts), messages


def parse_message(m: dict[str, Any], role: str, where: str) -> Message:
    content = parse_content(m.get("content"), where + "content")
    if role == "user":
        return Message(role="user", content=content)
    if role == "assistant":
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            content = [ReasoningPart(reasoning), *content]
        return Message(role="assistant", content=content, tool_calls=parse_tool_calls(m, where))
    if role in ("tool", "function"):
        call_id = opt_str(m, "tool_call_id", where) or ""
        return Message(
            role="tool", content=content, tool_call_id=call_id, name=opt_str(m, "name", where) or ""
        )
    raise bad(
        f"{where}role {role!r} is not one of system, developer, user, assistant, tool",
        where + "role",
    )


def parse_content(v: Any, where: str) -> list[Part]:
    if v is None:
        return []
    if isinstance(v, str):
        return [TextPart(v)]
    if not isinstance(v, list):
        raise bad(f"{where} must be a string or an array of parts", where)
    parts: list[Part] = []
    for i, item in enumerate(v):
        p = as_dict(item, f"{where}[{i}]")
        kind = p.get("type")
        if kind in ("text", "input_text", "output_text") or (kind is None and "text" in p):
            parts.append(TextPart(req_str(p, "text", f"{where}[{i}].")))
        elif kind == "image_url":
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise bad(f"{where}[{i}].image_url.url must be a string", f"{where}[{i}].image_url")
            parts.append(ImagePart(url))
        elif kind == "refusal":  # an assistant's earlier refusal: what it said
            parts.append(TextPart(opt_str(p, "refusal", f"{where}[{i}].") or ""))
        elif isinstance(kind, str) and kind in UNREADABLE_PARTS:
            field, (why, fix) = f"{where}[{i}].{kind}", UNREADABLE_PARTS[kind]
            raise bad(f"{field}: a {kind} part is not supported ({why}): {fix}", field)
        # other part types have no place in a text prompt: skipped
    return parts


def parse_tool_calls(m: dict[str, Any], where: str) -> list[ToolCall]:
    calls = []
    for i, item in enumerate(opt_list(m, "tool_calls", where)):
        c = as_dict(item, f"{where}tool_calls[{i}]")
        fn = opt_dict(c, "function", f"{where}tool_calls[{i}].") or opt_dict(
            c, "custom", f"{where}tool_calls[{i}]."
        )
        name = req_str(fn, "name", f"{where}tool_calls[{i}].function.")
        args = fn.get("arguments", fn.get("input"))
        calls.append(ToolCall(opt_str(c, "id", where) or f"call_{i}", name, json_text(args)))
    legacy = m.get("function_call")
    if isinstance(legacy, dict) and isinstance(legacy.get("name"), str):
        calls.append(ToolCall("call_legacy", legacy["name"], json_text(legacy.get("arguments"))))
    return calls


def parse_tools(raw: list[Any]) -> list[ToolSpec]:
    tools = []
    for i, item in enumerate(raw):
        t = as_dict(item, f"tools[{i}]")
        kind = t.get("type", "function")
        if kind == "function":
            fn = opt_dict(t, "function", f"tools[{i}].") or t
            tools.append(
                ToolSpec(
                    name=req_str(fn, "name", f"tools[{i}].function."),
                    description=opt_str(fn, "description", f"tools[{i}].function.") or "",
                    parameters=opt_dict(fn, "parameters", f"tools[{i}].function."),
                    field_order=field_order(fn),
                )
            )
        elif kind == "custom":
            fn = opt_dict(t, "custom", f"tools[{i}].") or t
            name = req_str(fn, "name", f"tools[{i}].custom.")
            desc = opt_str(fn, "description", f"tools[{i}].custom.") or ""
            tools.append(
                ToolSpec(
                    name=name,
                    description=desc,
                    parameters=CUSTOM_TOOL_PARAMETERS,
                    kind="custom",
                    raw=t,
                )
            )
        else:
            tools.append(ToolSpec(name=str(t.get("name") or kind), kind="other", raw=t))
    return tools


def parse_tool_choice(v: Any) -> ToolChoice | None:
    if v is None:
        return None
    if v in ("auto", "none", "required"):
        return ToolChoice(mode=v)
    if isinstance(v, dict):
        fn = v.get("function") or v.get("custom") or {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return ToolChoice(mode="named", name=fn["name"])
    raise bad("tool_choice must be auto, none, required or a named function", "tool_choice")


# ---------------------------------------------------------------- response


def usage_body(turn: AssistantTurn) -> dict[str, int]:
    u = turn.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def tool_calls_body(turn: AssistantTurn, ids: ReplyIds) -> list[dict[str, Any]]:
    return [
        openai_tool_call(ToolCall(ids.call_id("call_", i, c.id), c.name, c.arguments))
        for i, c in enumerate(turn.tool_calls)
    ]


def render_response(turn: AssistantTurn, conv: Conversation, ids: ReplyIds) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": turn.text or (None if turn.tool_calls else ""),
    }
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    if turn.tool_calls:
        message["tool_calls"] = tool_calls_body(turn, ids)
    return {
        "id": f"chatcmpl-{ids.token}",
        "object": "chat.completion",
        "created": ids.created,
        "model": conv.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": FINISH[turn.finish_reason],
            }
        ],
        "usage": usage_body(turn),
    }


def render_stream(turn: AssistantTurn, conv: Conversation, ids: ReplyIds) -> Iterator[SseEvent]:
    with_usage = bool(conv.metadata.get("include_usage"))

    def chunk(delta: dict[str, Any], finish: str | None = None) -> SseEvent:
        body = _chunk_head(conv, ids)
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        if with_usage:
            body["usage"] = None
        return SseEvent(body)

    yield chunk({"role": "assistant", "content": ""})
    if turn.reasoning:
        yield chunk({"reasoning_content": turn.reasoning})
    if turn.text:
        yield chunk({"content": turn.text})
    for i, call in enumerate(tool_calls_body(turn, ids)):
        fn = call["function"]
        yield chunk(
            {
                "tool_calls": [
                    {
                        "index": i,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": ""},
                    }
                ]
            }
        )
        yield chunk({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
    yield chunk({}, FINISH[turn.finish_reason])
    if with_usage:
        yield SseEvent({**_chunk_head(conv, ids), "choices": [], "usage": usage_body(turn)})
    yield DONE


def _chunk_head(conv: Conversation, ids: ReplyIds) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{ids.token}",
        "object": "chat.completion.chunk",
        "created": ids.created,
        "model": conv.model,
    }


def render_stream_error(
    kind: ErrorKind, message: str, conv: Conversation, ids: ReplyIds
) -> Iterator[SseEvent]:
    # The OpenAI SDKs raise on a data chunk that carries "error"; no [DONE] follows.
    yield SseEvent(openai_error_body(kind, message, None)[1])


def keepalive(conv: Conversation, ids: ReplyIds) -> bytes:
    return KEEPALIVE_COMMENT


# ---------------------------------------------------------------- errors (shared with Responses)

_OPENAI_ERRORS: dict[ErrorKind, tuple[str, str | None]] = {
    ErrorKind.BAD_REQUEST: ("invalid_request_error", None),
    ErrorKind.UNAUTHORIZED: ("invalid_request_error", "invalid_api_key"),
    ErrorKind.NOT_FOUND: ("invalid_request_error", "not_found"),
    ErrorKind.TOO_LARGE: ("invalid_request_error", "request_too_large"),
    ErrorKind.CONTEXT_LENGTH: ("invalid_request_error", "context_length_exceeded"),
    ErrorKind.OVERLOADED: ("server_error", "server_is_overloaded"),
    ErrorKind.UNAVAILABLE: ("server_error", "service_unavailable"),
    ErrorKind.CAPTURE_FAILED: ("server_error", "capture_failed"),
    ErrorKind.INTERNAL: ("server_error", "internal_error"),
}


def openai_error_body(
    kind: ErrorKind, message: str, param: str | None
) -> tuple[int, dict[str, Any]]:
    etype, code = _OPENAI_ERRORS[kind]
    return DEFAULT_STATUS[kind], {
        "error": {"message": message, "type": etype, "param": param, "code": code}
    }


PROTOCOL = ProtocolSpec(
    name=NAME,
    routes=(Route("POST", "/v1/chat/completions", Endpoint.GENERATE),),
    error_body=openai_error_body,
    parse_request=parse_request,
    render_response=render_response,
    render_stream=render_stream,
    render_stream_error=render_stream_error,
    keepalive=keepalive,
)
