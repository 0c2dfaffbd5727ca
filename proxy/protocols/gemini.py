"""Gemini: ``POST /v1beta/models/{model}:generateContent`` and
``:streamGenerateContent?alt=sse`` (Gemini CLI, pi), ``:countTokens``, model listing.

Stream grammar: data-only SSE, each event a ``GenerateContentResponse`` chunk; the last
carries ``finishReason`` and ``usageMetadata``. There is no terminator. Keep-alives are
chunks with one empty text part: Google's SDKs read every line as data (an SSE comment
would break them), and the Gemini CLI skips chunks without content.
Without ``alt=sse`` a stream is one JSON array of the same chunks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

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
from proxy.errors import DEFAULT_STATUS, ErrorKind, ProtocolError
from proxy.protocols.base import (
    Endpoint,
    ProtocolSpec,
    ReplyIds,
    Route,
    as_dict,
    bad,
    json_object,
    opt_count,
    opt_int,
    opt_list,
    opt_number,
    opt_str,
    req_str,
    stop_list,
)
from proxy.protocols.gemini_input import get, parse_contents, schema_to_json_schema, system_text
from proxy.sse import SseEvent, encode

NAME = "gemini"
ACTIONS = {
    "generateContent": Endpoint.GENERATE,
    "streamGenerateContent": Endpoint.GENERATE,
    "countTokens": Endpoint.COUNT_TOKENS,
}
FINISH = {"stop": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP", "abort": "MAX_TOKENS"}


def split_target(path_params: Mapping[str, Any]) -> tuple[str, str]:
    """``/{model}:{action}`` (the model may contain slashes) -> (model, action)."""
    target = str(path_params.get("target", "")).lstrip("/")
    model, _, action = target.rpartition(":")
    return (model, action) if model else (target, "")


def endpoint_for(path_params: Mapping[str, Any]) -> Endpoint:
    _, action = split_target(path_params)
    if action not in ACTIONS:
        raise ProtocolError(
            404,
            f"unknown method {action!r}: use generateContent, streamGenerateContent or countTokens",
        )
    return ACTIONS[action]


# ---------------------------------------------------------------- request


def _object(d: dict[str, Any], camel: str) -> dict[str, Any]:
    """An optional object field: absent or null is {}, any other non-object a 400."""
    v = get(d, camel)
    return {} if v is None else as_dict(v, camel)


def parse_request(
    body: dict[str, Any], path_params: Mapping[str, Any], query: Mapping[str, str]
) -> Conversation:
    model, action = split_target(path_params)
    request = body.get("generateContentRequest") if action == "countTokens" else None
    body = request if isinstance(request, dict) else body
    raw = body.get("contents")
    if not isinstance(raw, list):
        raise bad("contents must be an array", "contents")
    config = _object(body, "generationConfig")
    system = system_text(get(body, "systemInstruction"))
    messages, dropped = parse_contents(raw)
    return Conversation(
        model=model,
        system=system,
        messages=fill_tool_names(messages),
        tools=parse_tools(opt_list(body, "tools")),
        tool_choice=parse_tool_config(_object(body, "toolConfig")),
        sampling=parse_sampling(config),
        reasoning=parse_thinking(_object(config, "thinkingConfig")),
        response_format=response_format(config),
        stream=action == "streamGenerateContent" and query.get("alt") == "sse",
        metadata=metadata(action, query, dropped),
    )


def metadata(action: str, query: Mapping[str, str], dropped: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"dropped_parts": dropped} if dropped else {}
    if action == "streamGenerateContent" and query.get("alt") != "sse":
        out["json_array"] = True  # a stream asked for without SSE: one JSON array
    return out


def parse_sampling(c: dict[str, Any]) -> Sampling:
    at = "generationConfig."
    return Sampling(
        temperature=opt_number(c, "temperature", at),
        top_p=opt_number(c, "topP", at) if "topP" in c else opt_number(c, "top_p", at),
        top_k=opt_int(c, "topK", at) if "topK" in c else opt_int(c, "top_k", at),
        max_tokens=opt_count(c, "maxOutputTokens", at)
        if "maxOutputTokens" in c
        else opt_count(c, "max_output_tokens", at),
        stop=stop_list(get(c, "stopSequences"), at + "stopSequences"),
        seed=opt_int(c, "seed", at),
    )


def parse_tools(raw: list[Any]) -> list[ToolSpec]:
    tools: list[ToolSpec] = []
    for i, item in enumerate(raw):
        t = as_dict(item, f"tools[{i}]")
        decls = get(t, "functionDeclarations")
        if decls is None:
            tools.extend(
                ToolSpec(name=key, kind="other", raw={key: value}) for key, value in t.items()
            )
            continue
        if not isinstance(decls, list):
            raise bad(
                f"tools[{i}].functionDeclarations must be an array",
                f"tools[{i}].functionDeclarations",
            )
        tools.extend(
            function_declaration(
                as_dict(d, f"tools[{i}].functionDeclarations[{j}]"),
                f"tools[{i}].functionDeclarations[{j}].",
            )
            for j, d in enumerate(decls)
        )
    return tools


def function_declaration(d: dict[str, Any], at: str) -> ToolSpec:
    schema = get(d, "parametersJsonSchema")
    if schema is None and get(d, "parameters") is not None:
        schema = schema_to_json_schema(get(d, "parameters"))
    return ToolSpec(
        name=req_str(d, "name", at),
        description=opt_str(d, "description", at) or "",
        parameters=as_dict(schema, at + "parameters") if schema is not None else {},
        field_order=field_order(
            d, "parametersJsonSchema" if "parametersJsonSchema" in d else "parameters"
        ),
    )


def parse_tool_config(tc: dict[str, Any]) -> ToolChoice | None:
    fcc = get(tc, "functionCallingConfig")
    if not isinstance(fcc, dict):
        return None
    mode = str(fcc.get("mode", "AUTO")).upper()
    allowed = get(fcc, "allowedFunctionNames")
    if (
        mode in ("ANY", "VALIDATED")
        and isinstance(allowed, list)
        and len(allowed) == 1
        and isinstance(allowed[0], str)
    ):
        return ToolChoice(mode="named", name=allowed[0])
    return ToolChoice(mode={"ANY": "required", "NONE": "none"}.get(mode, "auto"))  # type: ignore[arg-type]


def parse_thinking(tc: dict[str, Any]) -> Reasoning | None:
    if not tc:
        return None
    budget = (
        opt_int(tc, "thinkingBudget", "thinkingConfig.")
        if "thinkingBudget" in tc
        else opt_int(tc, "thinking_budget", "thinkingConfig.")
    )
    level = get(tc, "thinkingLevel")
    return Reasoning(
        enabled=False if budget == 0 else (True if get(tc, "includeThoughts") else None),
        effort=level.lower() if isinstance(level, str) else None,
        budget_tokens=budget if budget and budget > 0 else None,
    )


def response_format(c: dict[str, Any]) -> dict[str, Any] | None:
    schema = get(c, "responseJsonSchema")
    if schema is None and get(c, "responseSchema") is not None:
        schema = schema_to_json_schema(get(c, "responseSchema"))
    if isinstance(schema, dict):
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    if get(c, "responseMimeType") == "application/json":
        return {"type": "json_object"}
    return None


# ---------------------------------------------------------------- response


def parts_of(turn: AssistantTurn, ids: ReplyIds) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if turn.reasoning:
        parts.append({"text": turn.reasoning, "thought": True})
    if turn.text or not turn.tool_calls:
        parts.append({"text": turn.text})
    for i, call in enumerate(turn.tool_calls):
        fc = {
            "id": ids.call_id("call_", i, call.id),
            "name": call.name,
            "args": json_object(call.arguments),
        }
        parts.append({"functionCall": fc})
    return parts


def chunk(
    conv: Conversation, ids: ReplyIds, parts: list[dict[str, Any]], turn: AssistantTurn | None
) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    body: dict[str, Any] = {"candidates": [candidate]}
    if turn is not None:
        candidate["finishReason"] = FINISH[turn.finish_reason]
        u = turn.usage
        body["usageMetadata"] = {
            "promptTokenCount": u.prompt_tokens,
            "candidatesTokenCount": u.completion_tokens,
            "totalTokenCount": u.prompt_tokens + u.completion_tokens,
        }
    body["modelVersion"] = conv.model
    body["responseId"] = ids.token
    return body


def render_response(turn: AssistantTurn, conv: Conversation, ids: ReplyIds) -> Any:
    if conv.metadata.get("json_array"):
        return [e.data for e in render_stream(turn, conv, ids)]
    return chunk(conv, ids, parts_of(turn, ids), turn)


def render_stream(turn: AssistantTurn, conv: Conversation, ids: ReplyIds) -> Iterator[SseEvent]:
    parts = parts_of(turn, ids)
    for part in parts[:-1]:
        yield SseEvent(chunk(conv, ids, [part], None))
    yield SseEvent(chunk(conv, ids, parts[-1:], turn))


def render_stream_error(
    kind: ErrorKind, message: str, conv: Conversation, ids: ReplyIds
) -> Iterator[SseEvent]:
    yield SseEvent(
        error_body(kind, message, None)[1]
    )  # the SDKs raise on a chunk that is {"error": …}


def keepalive(conv: Conversation, ids: ReplyIds) -> bytes:
    return encode(SseEvent(chunk(conv, ids, [{"text": ""}], None)))


def render_count_tokens(n: int) -> dict[str, Any]:
    return {"totalTokens": n}


def model_entry(model: str) -> dict[str, Any]:
    methods = ["generateContent", "streamGenerateContent", "countTokens"]
    return {"name": f"models/{model}", "displayName": model, "supportedGenerationMethods": methods}


def render_models(model: str, path_params: Mapping[str, Any]) -> dict[str, Any]:
    return model_entry(model) if path_params.get("target") else {"models": [model_entry(model)]}


# ---------------------------------------------------------------- errors

_STATUS_NAMES: dict[ErrorKind, str] = {
    ErrorKind.BAD_REQUEST: "INVALID_ARGUMENT",
    ErrorKind.UNAUTHORIZED: "UNAUTHENTICATED",
    ErrorKind.NOT_FOUND: "NOT_FOUND",
    ErrorKind.TOO_LARGE: "INVALID_ARGUMENT",
    ErrorKind.CONTEXT_LENGTH: "INVALID_ARGUMENT",
    ErrorKind.OVERLOADED: "UNAVAILABLE",
    ErrorKind.UNAVAILABLE: "UNAVAILABLE",
    ErrorKind.CAPTURE_FAILED: "UNAVAILABLE",
    ErrorKind.INTERNAL: "INTERNAL",
}


def error_body(kind: ErrorKind, message: str, param: str | None) -> tuple[int, dict[str, Any]]:
    status = DEFAULT_STATUS[kind]
    return status, {"error": {"code": status, "message": message, "status": _STATUS_NAMES[kind]}}


PROTOCOL = ProtocolSpec(
    name=NAME,
    routes=(
        Route("POST", "/v1beta/models/{target:path}", endpoint_for),
        Route("POST", "/v1/models/{target:path}", endpoint_for),  # google-genai 3.x defaults to v1
        Route("GET", "/v1beta/models", Endpoint.MODELS),
        Route("GET", "/v1beta/models/{target:path}", Endpoint.MODEL),
    ),
    error_body=error_body,
    parse_request=parse_request,
    render_response=render_response,
    render_stream=render_stream,
    render_stream_error=render_stream_error,
    keepalive=keepalive,
    render_count_tokens=render_count_tokens,
    render_models=render_models,
)
