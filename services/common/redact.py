"""Secrets out of what people read: session tokens and API keys in reasons, log lines,
artifacts, trajectories and exports become ``[redacted]``.

A session token (``ps_`` + 43 URL-safe characters, ``registry.new_token``) is the
harness's API key and URL secret, so it turns up in a CLI's error text
(``url: http://127.0.0.1:40309/s/ps_…/v1/responses``), its logs and its tool output. It
keeps its ``ps_`` so a reader still sees that a session URL was there. Keys of the usual
providers are matched by shape, and any value given as an API key, token, secret or
password (``OPENAI_API_KEY=…``, ``"api_key": "…"``, ``Authorization: Bearer …``) by the
name in front of it.

Every pattern matches only characters that JSON writes as themselves and every
replacement is plain text, so encoded JSON can be redacted as bytes (``redact_json``):
one scan of the encoded value, and a decode only when something was found.
"""

from __future__ import annotations

import logging
import re
from typing import TypeVar

import msgspec

REDACTED = "[redacted]"
_TOKEN_CHARS = r"[A-Za-z0-9_-]"
_SHAPES = (
    rf"(?P<session>ps_){_TOKEN_CHARS}{{20,}}",  # a session token
    rf"sk-{_TOKEN_CHARS}{{20,}}",  # OpenAI and Anthropic (sk-proj-…, sk-ant-…)
    r"AIza[0-9A-Za-z_-]{30,}",  # Google
    r"hf_[A-Za-z0-9]{30,}",  # Hugging Face
    r"gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}",  # GitHub
    r"AKIA[0-9A-Z]{16}",  # AWS access key id
)
# A value named as a secret: the name (and quotes, ``=``/``:``, "Bearer ") is kept.
_NAMED = (
    r"(?P<name>(?:(?<![A-Za-z0-9])bearer\s+)"
    r"|(?:(?:api[_-]?key|apikey|access[_-]?token|auth[_-]?token|secret(?:[_-]?key)?|password"
    r"|x-api-key|x-goog-api-key)\\?[\"']?\s*[:=]\s*\\?[\"']?(?:bearer\s+)?))"
    r"[^\s\"'&,;\\]{8,}"
)
_SOURCE = rf"(?<![A-Za-z0-9_-])(?:{'|'.join(_SHAPES)})|{_NAMED}"
_TEXT = re.compile(_SOURCE, re.IGNORECASE)
_BYTES = re.compile(_SOURCE.encode(), re.IGNORECASE)

T = TypeVar("T")


def _sub(m: re.Match) -> str:
    kept = m.group("session") or m.group("name") or ""
    return kept + REDACTED


def _sub_bytes(m: re.Match) -> bytes:
    kept = m.group("session") or m.group("name") or b""
    return kept + REDACTED.encode()


def redact(text: str | None) -> str | None:
    """``text`` with every session token and API key replaced."""
    if not text:
        return text
    return _TEXT.sub(_sub, text)


def redact_json(raw: bytes) -> bytes:
    """Encoded JSON with every secret inside its strings replaced (still valid JSON)."""
    return _BYTES.sub(_sub_bytes, raw)


def has_secret(raw: bytes) -> bool:
    return _BYTES.search(raw) is not None


def redact_struct(value: T) -> T:
    """A msgspec Struct (Trajectory, Artifacts, …) with every string redacted; the same
    object when it holds nothing to redact."""
    raw = msgspec.json.encode(value)
    if not has_secret(raw):
        return value
    return msgspec.json.decode(redact_json(raw), type=type(value))


def redact_value(value: object) -> object:
    """Strings anywhere in plain data (dicts, lists) redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_value(v) for v in value]
    return value


class RedactFilter(logging.Filter):
    """A handler filter: the record's message, exception and stack text, redacted (so a
    formatter or queue handler later only sees the redacted text)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True
