"""Pieces of the OpenAI-compatible wire shared by the SGLang and vLLM clients (pure)."""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from proxy.backends.base import BackendError, ErrorKind, FinishReason, SamplingParams, ToolCall

_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "abort": "abort",
    "content_filter": "stop",
}
_TOKEN_ID_PREFIX = "token_id:"


def bad_response(message: str, worker: str = "") -> BackendError:
    return BackendError(ErrorKind.BAD_RESPONSE, message, retryable=False, worker=worker)


def normalize_finish(value: Any) -> FinishReason:
    """SGLang native gives ``{"type": ..., "matched": ...}``; OpenAI shapes give a string.

    A missing reason on a finished non-streaming answer means the engine gave up on it.
    """
    if isinstance(value, dict):
        value = value.get("type")
    if value is None:
        return "abort"
    return _FINISH.get(str(value).lower(), "stop")


def matched_stop(finish: Any, choice: dict[str, Any] | None = None) -> int | str | None:
    if isinstance(finish, dict) and finish.get("matched") is not None:
        return finish["matched"]
    if choice is not None:
        for key in ("matched_stop", "stop_reason"):
            if choice.get(key) is not None:
                return choice[key]
    return None


def parse_tool_calls(message: dict[str, Any]) -> list[ToolCall]:
    calls = []
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") or {}
        args = fn.get("arguments")
        if not isinstance(args, str):  # some SGLang versions send an object
            args = orjson.dumps(args if args is not None else {}).decode()
        calls.append(
            ToolCall(id=call.get("id") or f"call_{i}", name=fn.get("name") or "", arguments=args)
        )
    return calls


def reasoning_text(message: dict[str, Any]) -> str | None:
    # vLLM >= 0.11 names it "reasoning"; SGLang and older vLLM "reasoning_content".
    return message.get("reasoning") or message.get("reasoning_content") or None


def content_logprobs(choice: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The OpenAI chat ``logprobs.content`` list, or None when absent."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict) or logprobs.get("content") is None:
        return None
    return logprobs["content"]


def token_id_from_text(token: Any) -> int | None:
    """vLLM's ``return_tokens_as_token_ids`` spells a token as ``"token_id:123"``."""
    if isinstance(token, str) and token.startswith(_TOKEN_ID_PREFIX):
        rest = token[len(_TOKEN_ID_PREFIX) :]
        if rest.isdigit():
            return int(rest)
    return None


# Token lists are checked by msgspec, in C: a 20k-token prompt's ids took ~0.6 ms as
# ``[int(v) for v in ids]`` and take ~0.05 ms. What it refuses (a null, a number sent as
# a string) goes through the old loop, which accepts or names it as before.
_IDS = list[int]
_FLOATS = list[float]


def float_logprobs(values: list[Any], what: str, worker: str = "") -> list[float]:
    try:
        return msgspec.convert(values, _FLOATS)
    except msgspec.ValidationError:
        pass
    out = []
    for i, value in enumerate(values):
        if value is None:
            raise bad_response(f"{what}: logprob {i} is null", worker)
        out.append(float(value))
    return out


def int_ids(values: Any, what: str, worker: str = "") -> list[int]:
    if not isinstance(values, list):
        raise bad_response(
            f"{what}: expected a list of token ids, got {type(values).__name__}", worker
        )
    return ids_of(values)


def ids_of(values: list[Any]) -> list[int]:
    """``values`` as ints (raises ValueError or TypeError for one that is none)."""
    try:
        return msgspec.convert(values, _IDS)
    except msgspec.ValidationError:
        return [int(v) for v in values]


def openai_sampling(s: SamplingParams) -> dict[str, Any]:
    """Sampling fields of an OpenAI-compatible chat or completions body."""
    body: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k", "seed"):
        if (value := getattr(s, key)) is not None:
            body[key] = value
    if s.max_new_tokens is not None:
        body["max_tokens"] = s.max_new_tokens
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    body.update(s.extra)
    return body


def chat_body(req: Any, default_model: str) -> dict[str, Any]:
    """The engine-neutral part of a non-streaming chat completions body."""
    body: dict[str, Any] = {
        "model": req.model or default_model,
        "messages": req.messages,
        "stream": False,
        "logprobs": True,
    }
    if req.tools:
        body["tools"] = req.tools
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    body.update(openai_sampling(req.sampling))
    body.update(req.extra_body)
    return body
