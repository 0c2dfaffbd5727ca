"""OpenAI Responses: ``POST /v1/responses`` (Codex CLI, pi).

Stream grammar: ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added`` … deltas … ``response.output_item.done`` (reasoning:
``reasoning_text``; message: ``content_part`` + ``output_text``; function call:
``function_call_arguments``; custom tool call: ``custom_tool_call_input``), then
``response.completed`` (or ``response.incomplete`` when the output was cut by length).
Every event carries a ``sequence_number``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from proxy.conversation import (
    CUSTOM_TOOL_PARAMETERS,
    AssistantTurn,
    Conversation,
    Reasoning,
    Sampling,
    ToolCall,
    ToolChoice,
    ToolSpec,
    field_order,
    fill_tool_names,
)
from proxy.errors import ErrorKind
from proxy.protocols import responses_input
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
    opt_list,
    opt_number,
    opt_str,
    req_str,
)
from proxy.protocols.openai_chat import openai_error_body
from proxy.sse import KEEPALIVE_COMMENT, SseEvent

NAME = "openai_responses"

# ---------------------------------------------------------------- request


def parse_request(
    body: dict[str, Any], path_params: Mapping[str, Any], query: Mapping[str, str]
) -> Conversation:
    if body.get("previous_response_id"):
        raise bad(
            "previous_response_id is not supported: this server stores no responses; send the full input",
            "previous_response_id",
        )
    instructions = opt_str(body, "instructions") or ""
    system, messages, dropped = responses_input.parse_input(body.get("input"), instructions)
    reasoning = opt_dict(body, "reasoning")
    metadata: dict[str, Any] = {"dropped_items": dropped} if dropped else {}
    return Conversation(
        model=opt_str(body, "model") or "",
        system=system,
        messages=fill_tool_names(messages),
        tools=parse_tools(opt_list(body, "tools")),
        tool_choice=parse_tool_choice(body.get("tool_choice")),
        sampling=Sampling(
            temperature=opt_number(body, "temperature"),
            top_p=opt_number(body, "top_p"),
            max_tokens=opt_count(body, "max_output_tokens"),
        ),
        reasoning=Reasoning(effort=opt_str(reasoning, "effort", "reasoning."))
        if reasoning
        else None,
        response_format=text_format(opt_dict(body, "text")),
        stream=bool(opt_bool(body, "stream")),
        metadata=metadata,
    )


def parse_tools(raw: list[Any], namespace: str = "", where: str = "tools") -> list[ToolSpec]:
    """Function and custom tools (also inside ``namespace`` tools) reach the model; hosted
    tools (web_search, image_generation, tool_search, …) are kept as kind ``other``."""
    tools: list[ToolSpec] = []
    for i, item in enumerate(raw):
        t = as_dict(item, f"{where}[{i}]")
        kind, at = t.get("type"), f"{where}[{i}]."
        if kind == "function":
            tools.append(
                ToolSpec(
                    name=req_str(t, "name", at),
                    description=opt_str(t, "description", at) or "",
                    parameters=opt_dict(t, "parameters", at),
                    namespace=namespace,
                    deferred=bool(t.get("defer_loading")),
                    field_order=field_order(t),
                )
            )
        elif kind == "custom":
            tools.append(
                ToolSpec(
                    name=req_str(t, "name", at),
                    description=opt_str(t, "description", at) or "",
                    parameters=CUSTOM_TOOL_PARAMETERS,
                    kind="custom",
                    namespace=namespace,
                    raw=t,
                )
            )
        elif kind == "namespace" and not namespace:
            tools.extend(
                parse_tools(opt_list(t, "tools", at), req_str(t, "name", at), f"{where}[{i}].tools")
            )
        else:
            tools.append(ToolSpec(name=str(t.get("name") or kind or "tool"), kind="other", raw=t))
    return tools


def parse_tool_choice(v: Any) -> ToolChoice | None:
    if v is None:
        return None
    if v in ("auto", "none", "required"):
        return ToolChoice(mode=v)
    if isinstance(v, dict) and isinstance(v.get("name"), str):
        return ToolChoice(mode="named", name=v["name"])
    if isinstance(v, dict):
        return None  # hosted-tool or allowed_tools choices: leave it to the model
    raise bad("tool_choice must be auto, none, required or an object", "tool_choice")


def text_format(text: dict[str, Any]) -> dict[str, Any] | None:
    fmt = text.get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        schema = {"name": fmt.get("name") or "response", "schema": fmt.get("schema") or {}}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": "json_object"}


# ---------------------------------------------------------------- response


def output_items(turn: AssistantTurn, conv: Conversation, ids: ReplyIds) -> list[dict[str, Any]]:
    """The finished output items, in the order the model produced them."""
    items: list[dict[str, Any]] = []
    if turn.reasoning:
        content = [{"type": "reasoning_text", "text": turn.reasoning}]
        items.append(
            {"id": f"rs_{ids.token}", "type": "reasoning", "summary": [], "content": content}
        )
    if turn.text or not turn.tool_calls:
        part = {"type": "output_text", "text": turn.text, "annotations": [], "logprobs": []}
        status = "completed" if final_status(turn) == "completed" else "incomplete"
        items.append(
            {
                "id": f"msg_{ids.token}",
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": [part],
            }
        )
    for i, call in enumerate(turn.tool_calls):
        items.append(call_item(call, i, conv, ids))
    return items


def call_item(call: ToolCall, i: int, conv: Conversation, ids: ReplyIds) -> dict[str, Any]:
    call_id = ids.call_id("call_", i, call.id)
    spec = conv.tool_named(call.name)
    if spec is not None and spec.kind == "custom":
        given = json_object(call.arguments).get("input")
        text = given if isinstance(given, str) else call.arguments
        item = {
            "id": f"ctc_{ids.token}{i}",
            "type": "custom_tool_call",
            "status": "completed",
            "call_id": call_id,
            "name": call.name,
            "input": text,
        }
    else:
        item = {
            "id": f"fc_{ids.token}{i}",
            "type": "function_call",
            "status": "completed",
            "arguments": call.arguments,
            "call_id": call_id,
            "name": call.name,
        }
    if spec is not None and spec.namespace:
        item["namespace"] = spec.namespace
    return item


def response_object(
    conv: Conversation,
    ids: ReplyIds,
    status: str,
    output: list[dict[str, Any]],
    turn: AssistantTurn | None,
) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": f"resp_{ids.token}",
        "object": "response",
        "created_at": ids.created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": None,
        "max_output_tokens": conv.sampling.max_tokens,
        "model": conv.model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": conv.reasoning.effort if conv.reasoning else None, "summary": None},
        "store": False,
        "temperature": conv.sampling.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": conv.sampling.top_p,
        "truncation": "disabled",
        "usage": usage_body(turn) if turn is not None else None,
        "metadata": {},
    }


def usage_body(turn: AssistantTurn) -> dict[str, Any]:
    u = turn.usage
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def final_status(turn: AssistantTurn) -> str:
    return "incomplete" if turn.finish_reason in ("length", "abort") else "completed"


def render_response(turn: AssistantTurn, conv: Conversation, ids: ReplyIds) -> dict[str, Any]:
    return response_object(conv, ids, final_status(turn), output_items(turn, conv, ids), turn)


def render_stream(turn: AssistantTurn, conv: Conversation, ids: ReplyIds) -> Iterator[SseEvent]:
    seq = _Sequence()
    yield seq.event(
        "response.created", response=response_object(conv, ids, "in_progress", [], None)
    )
    yield seq.event(
        "response.in_progress", response=response_object(conv, ids, "in_progress", [], None)
    )
    items = output_items(turn, conv, ids)
    for index, item in enumerate(items):
        yield from item_events(seq, index, item)
    status = final_status(turn)
    yield seq.event(f"response.{status}", response=response_object(conv, ids, status, items, turn))


def item_events(seq: _Sequence, index: int, item: dict[str, Any]) -> Iterator[SseEvent]:
    at = {"output_index": index, "item_id": item["id"]}
    kind = item["type"]
    yield seq.event("response.output_item.added", output_index=index, item=_in_progress(item))
    if kind == "reasoning":  # content parts as for messages (the JS SDK requires them)
        part = item["content"][0]
        yield seq.event(
            "response.content_part.added", **at, content_index=0, part={**part, "text": ""}
        )
        yield seq.event("response.reasoning_text.delta", **at, content_index=0, delta=part["text"])
        yield seq.event("response.reasoning_text.done", **at, content_index=0, text=part["text"])
        yield seq.event("response.content_part.done", **at, content_index=0, part=part)
    elif kind == "message":
        part = item["content"][0]
        yield seq.event(
            "response.content_part.added", **at, content_index=0, part={**part, "text": ""}
        )
        if part["text"]:
            yield seq.event(
                "response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=[]
            )
        yield seq.event(
            "response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[]
        )
        yield seq.event("response.content_part.done", **at, content_index=0, part=part)
    elif kind == "function_call":
        yield seq.event("response.function_call_arguments.delta", **at, delta=item["arguments"])
        yield seq.event(
            "response.function_call_arguments.done",
            **at,
            name=item["name"],
            arguments=item["arguments"],
        )
    else:  # custom_tool_call
        yield seq.event("response.custom_tool_call_input.delta", **at, delta=item["input"])
        yield seq.event("response.custom_tool_call_input.done", **at, input=item["input"])
    yield seq.event("response.output_item.done", output_index=index, item=item)


def _in_progress(item: dict[str, Any]) -> dict[str, Any]:
    """The item as first announced: empty content, empty arguments."""
    kind = item["type"]
    if kind == "reasoning":
        return {**item, "content": []}
    if kind == "message":
        return {**item, "status": "in_progress", "content": []}
    if kind == "function_call":
        return {**item, "status": "in_progress", "arguments": ""}
    return {**item, "status": "in_progress", "input": ""}


class _Sequence:
    def __init__(self) -> None:
        self.n = 0

    def event(self, kind: str, /, **fields: Any) -> SseEvent:
        body = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return SseEvent(body, kind)


_FAILURE_CODES = {
    ErrorKind.CONTEXT_LENGTH: "context_length_exceeded",
    ErrorKind.OVERLOADED: "server_is_overloaded",
    ErrorKind.BAD_REQUEST: "invalid_prompt",
}


def render_stream_error(
    kind: ErrorKind, message: str, conv: Conversation, ids: ReplyIds
) -> Iterator[SseEvent]:
    seq = _Sequence()
    yield seq.event(
        "response.created", response=response_object(conv, ids, "in_progress", [], None)
    )
    failed = response_object(conv, ids, "failed", [], None)
    failed["error"] = {"code": _FAILURE_CODES.get(kind, "server_error"), "message": message}
    yield seq.event("response.failed", response=failed)


def keepalive(conv: Conversation, ids: ReplyIds) -> bytes:
    return KEEPALIVE_COMMENT


PROTOCOL = ProtocolSpec(
    name=NAME,
    routes=(Route("POST", "/v1/responses", Endpoint.GENERATE),),
    error_body=openai_error_body,
    parse_request=parse_request,
    render_response=render_response,
    render_stream=render_stream,
    render_stream_error=render_stream_error,
    keepalive=keepalive,
)
