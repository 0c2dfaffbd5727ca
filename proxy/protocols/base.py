"""What a wire protocol module provides, and the checked readers its parsers share.

A protocol is translation only: ``parse_request`` (JSON body -> ``Conversation``),
``render_response`` / ``render_stream`` (``AssistantTurn`` -> JSON / SSE events),
``render_stream_error`` (an error after the stream has started), ``error_body`` (its
error shape and status per ``ErrorKind``) and ``keepalive`` (a protocol-legal frame that
keeps an idle stream open). The app mounts each ``Route`` at the root and under
``/s/{token}``.
"""

from __future__ import annotations

import enum
import json
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson
from msgspec import Struct

from proxy.conversation import AssistantTurn, Conversation
from proxy.errors import ErrorKind, ProtocolError
from proxy.sse import SseEvent


class Endpoint(enum.StrEnum):
    GENERATE = "generate"
    COUNT_TOKENS = "count_tokens"
    MODELS = "models"  # list the session's model
    MODEL = "model"  # describe one model


class Route(NamedTuple):
    method: str
    path: str  # below the root or the session prefix, e.g. "/v1/chat/completions"
    # fixed, or chosen from the path params (Gemini: ":generateContent" vs ":countTokens")
    endpoint: Endpoint | Callable[[Mapping[str, Any]], Endpoint]


class ReplyIds(Struct, frozen=True):
    """Per-reply identity; protocols derive their ids (chatcmpl-…, resp_…, msg_…) from it."""

    token: str
    created: int

    @classmethod
    def new(cls) -> ReplyIds:
        # unique, not secret: random's generator (seeded from the OS, again after a fork),
        # not secrets', whose getrandom() syscall was ~1.3% of the proxy's CPU per call
        return cls(f"{random.getrandbits(96):024x}", int(time.time()))

    def call_id(self, prefix: str, index: int, given: str) -> str:
        return given or f"{prefix}{self.token}{index}"


@dataclass(frozen=True, slots=True)
class ProtocolSpec:
    name: str
    routes: tuple[Route, ...]
    error_body: Callable[[ErrorKind, str, str | None], tuple[int, dict[str, Any]]]
    parse_request: (
        Callable[[dict[str, Any], Mapping[str, Any], Mapping[str, str]], Conversation] | None
    ) = None
    render_response: Callable[[AssistantTurn, Conversation, ReplyIds], Any] | None = None
    render_stream: Callable[[AssistantTurn, Conversation, ReplyIds], Iterator[SseEvent]] | None = (
        None
    )
    render_stream_error: (
        Callable[[ErrorKind, str, Conversation, ReplyIds], Iterator[SseEvent]] | None
    ) = None
    keepalive: Callable[[Conversation, ReplyIds], bytes] | None = None
    render_count_tokens: Callable[[int], dict[str, Any]] | None = None
    render_models: Callable[[str, Mapping[str, Any]], dict[str, Any]] | None = None


# ---- checked readers: wrong types become a 400 naming the field, never a crash ----


def bad(message: str, param: str | None = None) -> ProtocolError:
    return ProtocolError(400, message, param)


def opt_str(d: Mapping[str, Any], key: str, where: str = "") -> str | None:
    v = d.get(key)
    if v is None or isinstance(v, str):
        return v
    raise bad(f"{where}{key} must be a string", where + key)


def req_str(d: Mapping[str, Any], key: str, where: str = "") -> str:
    v = opt_str(d, key, where)
    if v is None:
        raise bad(f"{where}{key} is required", where + key)
    return v


def opt_list(d: Mapping[str, Any], key: str, where: str = "") -> list[Any]:
    v = d.get(key)
    if v is None:
        return []
    if isinstance(v, list):
        return v
    raise bad(f"{where}{key} must be an array", where + key)


def opt_dict(d: Mapping[str, Any], key: str, where: str = "") -> dict[str, Any]:
    v = d.get(key)
    if v is None:
        return {}
    if isinstance(v, dict):
        return v
    raise bad(f"{where}{key} must be an object", where + key)


def as_dict(v: Any, where: str) -> dict[str, Any]:
    if isinstance(v, dict):
        return v
    raise bad(f"{where} must be an object", where)


def opt_number(d: Mapping[str, Any], key: str, where: str = "") -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    raise bad(f"{where}{key} must be a number", where + key)


# The engines' JSON carries 64-bit integers: a bigger one (``1e308``) cannot even be
# encoded for them, so it is the caller's error here, not a crash later.
INT64 = (-(2**63), 2**63 - 1)
# No engine has a context this long: a bigger token count is a client bug.
MAX_TOKEN_COUNT = 2**31 - 1


def opt_int(
    d: Mapping[str, Any],
    key: str,
    where: str = "",
    minimum: int | None = None,
    maximum: int | None = None,
) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(f"{where}{key} must be an integer", where + key)
    lo = INT64[0] if minimum is None else minimum
    hi = INT64[1] if maximum is None else maximum
    if v < lo:
        raise bad(f"{where}{key} must be at least {lo}", where + key)
    if v > hi:
        raise bad(f"{where}{key} must be at most {hi}", where + key)
    return v


def opt_count(d: Mapping[str, Any], key: str, where: str = "") -> int | None:
    """A token count (max tokens, a thinking budget): 1 to ``MAX_TOKEN_COUNT``."""
    return opt_int(d, key, where, 1, MAX_TOKEN_COUNT)


def opt_bool(d: Mapping[str, Any], key: str, where: str = "") -> bool | None:
    v = d.get(key)
    if v is None or isinstance(v, bool):
        return v
    raise bad(f"{where}{key} must be a boolean", where + key)


def stop_list(v: Any, param: str) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise bad(f"{param} must be a string or an array of strings", param)


def json_text(value: Any) -> str:
    """Tool arguments as JSON text (some clients send an object instead of a string).

    Objects are written with ``", "`` and ``": "`` separators, the way Hermes/Qwen-style
    models write tool arguments, so a chat-mode engine re-rendering this history sees
    the text the model produced (compact JSON would drift on every tool turn)."""
    if isinstance(value, str):
        return value
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def json_object(arguments: str) -> dict[str, Any]:
    """A model's argument text as an object, for protocols that carry objects. Text that
    is not a JSON object is kept, wrapped, so the harness can report it to the model."""
    try:
        value = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


def data_url(media_type: str, data: str) -> str:
    return f"data:{media_type or 'application/octet-stream'};base64,{data}"
