"""SGLang's HTTP shapes, as pure translation: request bodies -> engine requests, engine
results -> response bodies. Field names follow SGLang's ``GenerateReqInput``,
``ChatCompletionRequest`` and ``meta_info`` (see docs/embedded-model-server in the report).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import msgspec
from msgspec import Struct

from services.common.tokenization import ChatTokenizer, ParsedReply, split_reasoning
from services.engine.sampling import SamplingParams, validate
from services.engine.sequence import GenerationResult


class ProtocolError(ValueError):
    """A request the server rejects with 400 (bad shape or values)."""


class GenerateBody(Struct, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # one prompt's ids, or a batch of them
    # one prompt's images, in the order of its image spans (data URLs or base64)
    image_data: list[str] | str | None = None
    sampling_params: dict[str, Any] | None = None
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    # an MoE model's expert ids per position: meta_info.routed_experts (SGLang's)
    return_routed_experts: bool = False
    stream: bool = False
    rid: str | list[str] | None = None


class ChatBody(Struct, kw_only=True):
    messages: list[dict[str, Any]] = []
    model: str = "default"
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    min_tokens: int = 0
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    separate_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    input_ids: list[int] | None = None
    return_prompt_token_ids: bool = False
    return_token_ids: bool = False
    return_meta_info: bool = False
    rid: str | None = None


def decode_body(raw: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"invalid request body: {exc}") from exc


# SGLang sampling features the embedded engine does not implement: accepted at their
# neutral value (clients send them), refused otherwise rather than silently ignored.
NEUTRAL_PARAMS: dict[str, Any] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "repetition_penalty": 1,
    "n": 1,
    "spaces_between_special_tokens": True,
    "stream_interval": None,
    "logit_bias": None,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "custom_params": None,
}


def _drop_neutral(raw: dict[str, Any]) -> None:
    for key, neutral in NEUTRAL_PARAMS.items():
        if key not in raw:
            continue
        value = raw.pop(key)
        if value is not None and value != neutral and value != {} and key != "stream_interval":
            raise ProtocolError(f"{key}={value!r} is not supported by the embedded engine")


def sampling_params(raw: dict[str, Any] | None, default_max: int) -> SamplingParams:
    """SGLang ``sampling_params`` dict -> SamplingParams. Unknown keys are an error."""
    raw = dict(raw or {})
    _drop_neutral(raw)
    if isinstance(raw.get("stop"), str):
        raw["stop"] = [raw["stop"]]
    if raw.get("top_k") == 0:
        raw["top_k"] = -1
    raw.setdefault("max_new_tokens", default_max)
    for key in [k for k, v in raw.items() if v is None]:
        del raw[key]  # JSON null means "default", as in SGLang
    try:
        params = msgspec.convert(raw, SamplingParams, strict=False)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid sampling_params: {exc}") from exc
    problem = validate(params)
    if problem:
        raise ProtocolError(problem)
    return params


def chat_sampling_params(body: ChatBody, default_max: int, seed_offset: int = 0) -> SamplingParams:
    if body.top_logprobs:
        raise ProtocolError("top_logprobs is not supported by the embedded engine")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise ProtocolError(
            "response_format other than text is not supported by the embedded engine"
        )
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    seed = None if body.seed is None else body.seed + seed_offset
    return sampling_params(
        {
            "max_new_tokens": body.max_completion_tokens or body.max_tokens or default_max,
            "min_new_tokens": body.min_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "stop": stop,
            "stop_token_ids": body.stop_token_ids,
            "ignore_eos": body.ignore_eos,
            "skip_special_tokens": body.skip_special_tokens,
            "no_stop_trim": body.no_stop_trim,
            "sampling_seed": seed,
            "frequency_penalty": body.frequency_penalty,
            "presence_penalty": body.presence_penalty,
            "repetition_penalty": body.repetition_penalty,
            "logit_bias": body.logit_bias,
        },
        default_max,
    )


def generate_prompts(body: GenerateBody, tokenizer: ChatTokenizer) -> tuple[list[list[int]], bool]:
    """(prompts as ids, whether the request was a batch)."""
    if body.input_ids is not None:
        ids = body.input_ids
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        if not all(isinstance(p, list) and all(type(t) is int for t in p) for p in prompts):
            raise ProtocolError("input_ids must be a list of token ids or a list of such lists")
        return [list(p) for p in prompts], batch
    if body.text is not None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        return [tokenizer.encode(t) for t in texts], isinstance(body.text, list)
    raise ProtocolError("either text or input_ids is required")


def meta_info(
    result: GenerationResult, tokenizer: ChatTokenizer, logprobs: bool, with_text: bool
) -> dict:
    """SGLang's ``meta_info`` for one result; token logprobs are [logprob, id, text|None]."""
    info: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": len(result.prompt_ids),
        "completion_tokens": len(result.output_ids),
        "cached_tokens": result.cached_tokens,
        "weight_version": result.weight_version,
        "weight_versions": result.weight_versions,
        "weight_version_starts": result.weight_version_starts,
        "e2e_latency": result.e2e_seconds,
        "queue_time": result.queue_seconds,
    }
    if logprobs:
        info["output_token_logprobs"] = [
            [lp, tid, tokenizer.token_text(tid) if with_text else None]
            for lp, tid in zip(result.output_logprobs, result.output_ids, strict=True)
        ]
    if result.routed_experts is not None:
        info["routed_experts"] = routed_experts_b64(result.routed_experts)
    return info


def routed_experts_b64(rows) -> str:
    """SGLang's wire form of routing rows: base64 of little-endian int32, C order (clients
    decode with ``np.frombuffer(b64decode(s), np.int32).reshape(-1, layers, top_k)``)."""
    return base64.b64encode(rows.numpy().astype("<i4", copy=False).tobytes()).decode("ascii")


def generate_response(
    result: GenerationResult, body: GenerateBody, tokenizer: ChatTokenizer
) -> dict:
    return {
        "text": result.text,
        "output_ids": result.output_ids,
        "meta_info": meta_info(
            result, tokenizer, body.return_logprob, body.return_text_in_logprobs
        ),
    }


def _openai_finish(result: GenerationResult, has_tool_calls: bool) -> tuple[str, int | str | None]:
    kind = result.finish_reason.get("type")
    if kind == "length":
        return "length", None
    if kind == "abort":
        return "abort", None
    matched = result.finish_reason.get("matched")
    return ("tool_calls" if has_tool_calls else "stop"), matched


def _tool_call_json(call, index: int) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "index": index,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def chat_message(reply: ParsedReply, separate_reasoning: bool, raw_text: str) -> dict:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None,
        "reasoning_content": None,
        "tool_calls": None,
    }
    if separate_reasoning:
        message["reasoning_content"] = reply.reasoning
        message["content"] = reply.content
    else:
        message["content"] = raw_text if not reply.tool_calls else reply.content
    if reply.tool_calls:
        message["tool_calls"] = [_tool_call_json(c, i) for i, c in enumerate(reply.tool_calls)]
        message["content"] = message["content"] or None
    return message


def chat_choice(
    index: int, result: GenerationResult, body: ChatBody, tokenizer: ChatTokenizer
) -> dict:
    tools = body.tools if body.tool_choice != "none" else None
    reply = (
        tokenizer.parse_reply(result.output_ids, tools, result.prompt_ids)
        if tools
        else _plain_reply(result, tokenizer)
    )
    finish, matched = _openai_finish(result, bool(reply.tool_calls))
    choice: dict[str, Any] = {
        "index": index,
        "message": chat_message(reply, body.separate_reasoning, result.text),
        "logprobs": _openai_logprobs(result, tokenizer) if body.logprobs else None,
        "finish_reason": finish,
        "matched_stop": matched,
    }
    if body.return_prompt_token_ids:
        choice["prompt_token_ids"] = result.prompt_ids
    if body.return_token_ids:
        choice["token_ids"] = result.output_ids
    if body.return_meta_info:
        choice["meta_info"] = meta_info(result, tokenizer, body.logprobs, True)
    return choice


def _plain_reply(result: GenerationResult, tokenizer: ChatTokenizer) -> ParsedReply:
    reasoning, rest = split_reasoning(result.text)
    return ParsedReply(content=rest, reasoning=reasoning, tool_calls=[], errors=[])


def _openai_logprobs(result: GenerationResult, tokenizer: ChatTokenizer) -> dict:
    content = []
    for lp, tid in zip(result.output_logprobs, result.output_ids, strict=True):
        text = tokenizer.token_text(tid)
        content.append(
            {"token": text, "bytes": list(text.encode("utf-8")), "logprob": lp, "top_logprobs": []}
        )
    return {"content": content}


def chat_response(
    results: list[GenerationResult], body: ChatBody, tokenizer: ChatTokenizer
) -> dict:
    prompt_tokens = len(results[0].prompt_ids)
    completion = sum(len(r.output_ids) for r in results)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [chat_choice(i, r, body, tokenizer) for i, r in enumerate(results)],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": results[0].cached_tokens},
        },
        "metadata": {"weight_version": results[0].weight_version},
    }


def error_body(message: str, status: int, kind: str) -> dict:
    """SGLang's ErrorResponse shape."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}
