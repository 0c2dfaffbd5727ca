"""Llama 3.1 / 3.2 / 3.3: JSON tool calls, as vLLM's and SGLang's ``llama3_json`` parsers
read them.

A tool-calling reply is one JSON object per call, ``{"name": ..., "parameters": {...}}``
(the official template's key; ``"arguments"`` is accepted too), optionally after
``<|python_tag|>``, several separated by ``;``. Anything else is plain text. The model has
no reasoning block. ``<|eot_id|>`` / ``<|eom_id|>`` end the turn and are not in the text.

Where the engines differ we follow SGLang: a reply is a tool call when it *starts* with
``{`` or carries ``<|python_tag|>`` (vLLM also tries every ``{`` inside prose, which turns
an answer quoting JSON into content only by luck), and text before the tag or after the
last call stays content. A JSON answer that is not shaped like a call (a ``"name"`` and
``"parameters"`` or ``"arguments"``) is content, not a failure.
"""

from __future__ import annotations

import json
import re
from typing import Any

from services.common.tokenization.families.base import ModelFamily
from services.common.tokenization.toolcalls import (
    ParsedReply,
    ParsedToolCall,
    ToolCallFailure,
    parse_json_call,
)

PYTHON_TAG = "<|python_tag|>"
EOT = "<|eot_id|>"
EOM = "<|eom_id|>"

# an object that opens with a "name" key: a call even when it does not parse
_CALL_OPENING = re.compile(r'\{\s*"name"\s*:')
_SEPARATOR = re.compile(r"\s*(?:;\s*)?")
_decoder = json.JSONDecoder()


def parse_llama(
    text: str, tools: list[dict[str, Any]] | None = None, *, reasoning_open: bool = False
) -> ParsedReply:
    """Split a Llama 3.x reply into content and tool calls (``reasoning_open`` is ignored:
    the family does not reason). Markup that does not parse stays in content and is listed
    in errors and failures."""
    head, tag, _ = text.partition(PYTHON_TAG)
    if tag:
        start = len(head) + len(tag)
    elif text.lstrip().startswith("{"):
        head, start = "", 0
    else:
        return ParsedReply(content=text, reasoning=None, tool_calls=[], errors=[], failures=[])
    calls, consumed, failure = _read_calls(text, start, tagged=bool(tag))
    content = (head + text[consumed:]).strip() if calls else text
    failures = [failure] if failure else []
    return ParsedReply(
        content=content,
        reasoning=None,
        tool_calls=calls,
        errors=[f.detail for f in failures],
        failures=failures,
    )


def _read_calls(
    text: str, pos: int, *, tagged: bool
) -> tuple[list[ParsedToolCall], int, ToolCallFailure | None]:
    """The calls from ``pos`` on, where the last one ends, and the failure that stopped the
    reading (it spans the rest of the text: past bad JSON nothing can be trusted)."""
    calls: list[ParsedToolCall] = []
    pos = _SEPARATOR.match(text, pos).end()
    while pos < len(text):
        if text[pos] != "{":
            if tagged and not calls:  # the tag promised a call: builtin code, prose
                return calls, pos, _malformed("no JSON tool call after <|python_tag|>", pos, text)
            break  # prose after the calls: content
        try:
            obj, end = _decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if not (tagged or calls or _CALL_OPENING.match(text, pos)):
                break  # a reply that merely starts with a brace
            detail = f"tool call is not valid JSON: {exc.msg} (character {exc.pos - pos})"
            return calls, pos, _malformed(detail, pos, text)
        if not (tagged or calls or _call_shaped(obj)):
            break  # a JSON answer, not a call
        try:
            calls.append(parse_json_call(text[pos:end]))
        except ValueError as exc:
            return calls, pos, _malformed(str(exc), pos, text)
        pos = _SEPARATOR.match(text, end).end()
    return calls, pos, None


def _call_shaped(obj: Any) -> bool:
    # vLLM's test too: a name and the arguments under either key
    return isinstance(obj, dict) and "name" in obj and ("parameters" in obj or "arguments" in obj)


def _malformed(detail: str, start: int, text: str) -> ToolCallFailure:
    return ToolCallFailure("malformed", detail, start, len(text.rstrip()))


FAMILY = ModelFamily(
    name="llama3",
    parse=parse_llama,
    turn_ends=(EOT, EOM),
    notes="Llama 3.1/3.2/3.3: JSON tool calls ({name, parameters}, ';'-separated), no reasoning",
)
