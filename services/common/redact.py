"""Secrets out of what people read: session tokens and API keys in reasons, log lines,
artifacts, trajectories and exports become ``[redacted]``.

A session token (``ps_`` + 43 URL-safe characters, ``registry.new_token``) is the
harness's API key and URL secret, so it turns up in a CLI's error text
(``url: http://127.0.0.1:40309/s/ps_…/v1/responses``), its logs and its tool output. It
keeps its ``ps_`` so a reader still sees that a session URL was there. Keys of the usual
providers are matched by shape, and any value given as an API key, token, secret or
password (``OPENAI_API_KEY=…``, ``"api_key": "…"``, ``Authorization: Bearer …``) by the
name in front of it, and a URL's password (``nats://user:pass@host``) by its place.

Every pattern matches only characters that JSON writes as themselves and every
replacement is plain text, so raw output and encoded JSON can be redacted as bytes
(``redact_bytes``; JSON stays valid): one scan of the encoded value, and a decode only
when something was found.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
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
# A password in a URL (``nats://cli:secret@host``, ``redis://:secret@host``): the
# scheme's ``://`` is kept, the user and password go.
_URL_USERINFO = r"(?P<url>://)[^\s/@:\"'\\]*:[^\s/@\"'\\]+(?=@)"
_SHAPE_SOURCE = rf"(?<![A-Za-z0-9_-])(?:{'|'.join(_SHAPES)})|{_URL_USERINFO}"
# A value named as a secret: the name (and quotes, ``=``/``:``, "Bearer ") is kept.
_NAME_SOURCE = (
    r"(?P<name>(?:(?<![A-Za-z0-9])bearer\s+)"
    r"|(?:(?:api[_-]?key|apikey|access[_-]?token|auth[_-]?token|secret(?:[_-]?key)?|password"
    r"|x-api-key|x-goog-api-key)\\?[\"']?\s*[:=]\s*\\?[\"']?(?:bearer\s+)?))"
    r"[^\s\"'&,;\\]{8,}"
)
# Where a match can start: the literal each pattern begins with (a name is looked for
# lower-cased; "x-api-key" and "x-goog-api-key" start 2 and 7 characters before their
# "api-key"). A regex scan of a whole trajectory costs ~200 ms per MB, finding literals
# well under 1 ms, so the patterns are tried only where a literal is.
_SHAPE_MARKS = (
    "://",
    "ps_",
    "sk-",
    "AIza",
    "hf_",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "github_pat_",
    "AKIA",
)
_NAME_MARKS = (
    "bearer",
    "api_key",
    "api-key",
    "apikey",
    "access_token",
    "access-token",
    "auth_token",
    "auth-token",
    "secret",
    "password",
)
_NAME_BACKS = (0, 2, 7)


class _Redactor:
    """The patterns for one string type (``str`` or ``bytes``)."""

    def __init__(self, kind: type) -> None:
        enc = (lambda x: x.encode()) if kind is bytes else (lambda x: x)
        self.shapes = re.compile(enc(_SHAPE_SOURCE))
        self.names = re.compile(enc(_NAME_SOURCE), re.IGNORECASE)
        self.shape_marks = tuple(enc(m) for m in _SHAPE_MARKS)
        self.name_marks = tuple(enc(m) for m in _NAME_MARKS)
        self.redacted = enc(REDACTED)
        self.empty = enc("")

    def matches(self, data) -> list[re.Match]:
        """Non-overlapping matches, in order."""
        lower = data.lower()
        if len(lower) != len(data):  # a str whose case mapping moves positions: scan all
            found = [*self.shapes.finditer(data), *self.names.finditer(data)]
        else:
            found = self._at(self.shapes, self.shape_marks, data, data, (0,))
            found += self._at(self.names, self.name_marks, lower, data, _NAME_BACKS)
        found.sort(key=lambda m: m.start())
        kept: list[re.Match] = []
        for m in found:
            if not kept or m.start() >= kept[-1].end():
                kept.append(m)
        return kept

    @staticmethod
    def _at(regex: re.Pattern, marks, hay, data, backs) -> list[re.Match]:
        found = []
        for mark in marks:
            i = hay.find(mark)
            while i != -1:
                for back in backs:
                    m = regex.match(data, i - back) if i >= back else None
                    if m:
                        found.append(m)
                        break
                i = hay.find(mark, i + 1)
        return found

    def __call__(self, data):
        parts, last = [], 0
        for m in self.matches(data):
            if "session" in m.re.groupindex:
                kept = m.group("session") or m.group("url")
            else:
                kept = m.group("name")
            parts += [data[last : m.start()], kept or self.empty, self.redacted]
            last = m.end()
        if not parts:
            return data
        parts.append(data[last:])
        return self.empty.join(parts)


_TEXT, _BYTES = _Redactor(str), _Redactor(bytes)
T = TypeVar("T")


def redact(text: str | None) -> str | None:
    """``text`` with every session token and API key replaced."""
    return _TEXT(text) if text else text


def redact_bytes(raw: bytes) -> bytes:
    """Raw output, or encoded JSON (which stays valid), with every secret replaced."""
    return _BYTES(raw)


def has_secret(raw: bytes) -> bool:
    return bool(_BYTES.matches(raw))


def redact_struct(value: T) -> T:
    """A msgspec Struct (Trajectory, Artifacts, …) with every string redacted; the same
    object when it holds nothing to redact."""
    raw = msgspec.json.encode(value)
    if not has_secret(raw):
        return value
    return msgspec.json.decode(redact_bytes(raw), type=type(value))


def redact_value(value: object) -> object:
    """Strings anywhere in plain data (dicts, lists) redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_value(v) for v in value]
    return value


MIN_KNOWN = 8  # shorter known values would blank out ordinary words


def known_secrets(token: str | None, spec) -> list[str]:
    """What a session's output must not carry, whatever it looks like: its own token
    (with and without ``ps_``) and every env value its task (a ``TaskRequest``, or None)
    gave it. The executor scrubs the output with these; the dashboard what it shows."""
    found = [token, token.removeprefix("ps_")] if token else []
    if spec is not None:
        envs = [spec.agent.env, spec.runtime.env]
        envs += [a.env for a in spec.runtime.prepare if hasattr(a, "env")]
        found += [v for env in envs for v in env.values()]
    return found


def scrub_known(raw: bytes, known: Iterable[str]) -> bytes:
    """``raw`` with every occurrence of these exact values (a session's own token, the
    task's env values) replaced, whatever their shape; then redacted by shape. A harness
    may print a secret without anything that marks it as one (the token without its
    ``ps_``, an env value in its own words), and a tail may start in the middle of one:
    scrub the whole output before cutting its tail. (By shape first: a marked token
    keeps its ``ps_``.)"""
    raw = redact_bytes(raw)
    for value in sorted({k for k in known if len(k) >= MIN_KNOWN}, key=len, reverse=True):
        raw = raw.replace(value.encode(), _BYTES.redacted)
    return raw


def scrub_known_struct(value: T, known: Iterable[str]) -> T:
    """A msgspec Struct with ``scrub_known`` applied to its JSON (values as JSON writes
    them inside strings)."""
    raw = msgspec.json.encode(value)
    escaped = [msgspec.json.encode(k)[1:-1].decode() for k in known]
    clean = scrub_known(raw, escaped)
    return value if clean == raw else msgspec.json.decode(clean, type=type(value))


class Scrubber:
    """``scrub_known`` for plain data a reader is shown (the dashboard's JSON): every
    string redacted by shape, then these known values replaced, each as given and as JSON
    writes it inside a string (a request body shown as JSON text)."""

    def __init__(self, known: Iterable[str] = ()) -> None:
        forms = {f for k in known if len(k) >= MIN_KNOWN for f in (k, _json_inner(k))}
        self.known = sorted(forms, key=len, reverse=True)

    def text(self, text: str) -> str:
        if len(text) < MIN_KNOWN:  # too short to hold a known value or a shape
            return text
        text = _TEXT(text)
        for value in self.known:
            if value in text:
                text = text.replace(value, REDACTED)
        return text

    def value(self, value: object) -> object:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: self.value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(v) for v in value]
        return value

    def spans(self, text: str) -> list[tuple[int, int]]:
        """Where ``text`` holds a secret (by shape or known), sorted, maybe overlapping:
        to mask the pieces (tokens) a secret was cut into."""
        found = [(m.start(), m.end()) for m in _TEXT.matches(text)]
        for value in self.known:
            i = text.find(value)
            while i != -1:
                found.append((i, i + len(value)))
                i = text.find(value, i + 1)
        return sorted(found)


def _json_inner(text: str) -> str:
    return msgspec.json.encode(text)[1:-1].decode()


ENV_KEYS = frozenset({"env"})


def redact_env(value: object) -> object:
    """Plain data (a task spec as dicts and lists) with every ``env`` mapping's values
    replaced, whatever they look like (a task's env is where its secrets go: an API key
    for a harness, a registry password), and every other string redacted by shape."""
    if isinstance(value, dict):
        return {
            k: {name: REDACTED for name in v}
            if k in ENV_KEYS and isinstance(v, dict)
            else redact_env(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact_env(v) for v in value]
    return redact(value) if isinstance(value, str) else value


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
