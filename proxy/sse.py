"""Server-sent events: the only place that frames them.

Protocols yield ``SseEvent``s (an optional ``event:`` name and a JSON-able payload, or
the literal ``[DONE]``); ``encode`` turns them into bytes. Keep-alives are either an SSE
comment or, for Anthropic, a ``ping`` event. ``SseParser`` reads a byte stream back into
events, in any chunking (used by tests and by anything that consumes our streams).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson
from msgspec import Struct

DONE_DATA = "[DONE]"
KEEPALIVE_COMMENT = b": keep-alive\n\n"


class SseEvent(Struct, frozen=True):
    data: Any  # a JSON-able value, or a str sent verbatim (e.g. "[DONE]")
    event: str | None = None


DONE = SseEvent(DONE_DATA)
ANTHROPIC_PING = SseEvent({"type": "ping"}, "ping")


def encode(ev: SseEvent) -> bytes:
    data = ev.data.encode() if isinstance(ev.data, str) else orjson.dumps(ev.data)
    lines = b"".join(b"data: " + line + b"\n" for line in data.split(b"\n"))
    if ev.event is None:
        return lines + b"\n"
    return b"event: " + ev.event.encode() + b"\n" + lines + b"\n"


def encode_all(events: Iterable[SseEvent]) -> bytes:
    return b"".join(encode(e) for e in events)


class SseParser:
    """Incremental SSE reader (WHATWG rules: CR, LF or CRLF line ends; comments skipped;
    multi-line data joined by newlines; an event is dispatched on a blank line)."""

    def __init__(self) -> None:
        self._buf = b""
        self._event: str | None = None
        self._data: list[str] = []
        self.comments: list[str] = []

    def feed(self, chunk: bytes) -> list[SseEvent]:
        self._buf += chunk
        out: list[SseEvent] = []
        while True:
            line, rest = _split_line(self._buf)
            if line is None:
                return out
            self._buf = rest
            ev = self._line(line.decode())
            if ev is not None:
                out.append(ev)

    def close(self) -> list[SseEvent]:
        """End of stream: a trailing CR ends its line."""
        line, self._buf = self._buf, b""
        if not line.endswith(b"\r"):
            return []
        ev = self._line(line[:-1].decode())
        return [ev] if ev is not None else []

    def _line(self, line: str) -> SseEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            self.comments.append(line[1:].strip())
            return None
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            self._event = value
        elif field == "data":
            self._data.append(value)
        return None

    def _dispatch(self) -> SseEvent | None:
        event, data = self._event, self._data
        self._event, self._data = None, []
        if not data:
            return None
        text = "\n".join(data)
        return SseEvent(text if text == DONE_DATA else orjson.loads(text), event)


def _split_line(buf: bytes) -> tuple[bytes | None, bytes]:
    """(first complete line, the rest); a trailing CR waits for a possible LF."""
    lf, cr = buf.find(b"\n"), buf.find(b"\r")
    if cr == -1 or (lf != -1 and lf < cr):
        return (None, buf) if lf == -1 else (buf[:lf], buf[lf + 1 :])
    if cr + 1 == len(buf):
        return None, buf
    skip = 2 if buf[cr + 1 : cr + 2] == b"\n" else 1
    return buf[:cr], buf[cr + skip :]


def parse(chunks: Iterable[bytes]) -> list[SseEvent]:
    parser = SseParser()
    return [ev for chunk in chunks for ev in parser.feed(chunk)] + parser.close()
