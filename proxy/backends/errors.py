"""Engine error bodies -> ``BackendError`` (pure).

The shapes seen across SGLang and vLLM versions (see tests/fixtures/backends/README.md):
  flat OpenAI-style   {"object": "error", "message": ..., "type": ..., "code": 400}
  nested OpenAI-style {"error": {"message": ..., "type": ..., "code": 400}}
  SGLang native       {"error": {"message": ...}}          (/generate)
  FastAPI             {"detail": "..."} or {"detail": [{"msg": ...}, ...]}
  vLLM dev endpoints  {"error": "..."}
  plain text          "Cache flushed..." style bodies
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.backends.base import BackendError, ErrorKind

# Phrases engines use when prompt + max tokens exceed the context window.
_CONTEXT_PHRASES = (
    "context length",
    "context window",
    "maximum context",
    "longer than the model",
    "maximum model length",  # vLLM 0.32 tokens-in: "The decoder prompt (length N) is ..."
    "prompt is too long",
    "too many tokens",
    "context limit",  # Polar's embedded engine: "prompt has N tokens; the context limit is M"
)
_OVERLOAD_PHRASES = ("queue is full", "too many requests", "overloaded", "no available workers")
_MAX_MESSAGE = 2000


def error_message(body: bytes) -> str:
    """The human message inside any known error body shape."""
    try:
        doc = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace").strip()[:_MAX_MESSAGE]
    return _message_from_doc(doc)[:_MAX_MESSAGE]


def _message_from_doc(doc: Any) -> str:
    if isinstance(doc, str):
        return doc
    if not isinstance(doc, dict):
        return "" if doc is None else orjson.dumps(doc).decode()
    for key in ("message", "error", "detail"):
        value = doc.get(key)
        if isinstance(value, str):
            return value
        if isinstance(value, dict):
            return _message_from_doc(value)
        if isinstance(value, list) and value:
            return "; ".join(_message_from_doc(item) or str(item) for item in value)
    if isinstance(doc.get("msg"), str):
        return doc["msg"]
    return orjson.dumps(doc).decode()


def classify(status: int, message: str) -> ErrorKind:
    lowered = message.lower()
    if any(p in lowered for p in _CONTEXT_PHRASES):
        return ErrorKind.CONTEXT_LENGTH
    if status == 429 or any(p in lowered for p in _OVERLOAD_PHRASES):
        return ErrorKind.OVERLOADED
    if status == 404:
        return ErrorKind.NOT_FOUND
    if status in (408, 504):
        return ErrorKind.TIMEOUT
    if status in (502, 503):
        return ErrorKind.UNAVAILABLE
    if status >= 500:
        return ErrorKind.SERVER_ERROR
    return ErrorKind.BAD_REQUEST


def error_from_response(status: int, body: bytes, worker: str = "") -> BackendError:
    message = error_message(body) or f"HTTP {status}"
    return BackendError(classify(status, message), message, status=status, worker=worker)
