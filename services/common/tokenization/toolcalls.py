"""Parse generated assistant text into reasoning, content and tool calls.

Two tool-call encodings are understood, both wrapped in ``<tool_call>...</tool_call>``:

* Hermes/Qwen JSON: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``
* qwen3_coder XML: ``<tool_call>\\n<function=f>\\n<parameter=p>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>``

Reasoning is the text inside ``<think>...</think>`` at the start of the reply. Parsing is
pure and lossless about failures: a block that cannot be parsed stays in ``content`` and is
reported in ``errors``, so a caller never silently drops what the model wrote.
"""

from __future__ import annotations

import json
import re
from typing import Any

from msgspec import Struct

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


class ParsedToolCall(Struct, frozen=True):
    name: str
    arguments: str  # a JSON object, serialized (OpenAI's function.arguments)


class ParsedReply(Struct, frozen=True):
    content: str
    reasoning: str | None
    tool_calls: list[ParsedToolCall]
    errors: list[str]


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, rest). Reasoning is what precedes ``</think>`` (an opening tag optional);
    an unclosed ``<think>`` at the start makes the whole remainder reasoning (truncated)."""
    stripped = text.lstrip()
    if THINK_CLOSE in text:
        head, _, rest = text.partition(THINK_CLOSE)
        head = head.lstrip()
        if head.startswith(THINK_OPEN):
            head = head[len(THINK_OPEN) :]
        return head.strip("\n"), rest.lstrip("\n")
    if stripped.startswith(THINK_OPEN):
        return stripped[len(THINK_OPEN) :].strip("\n"), ""
    return None, text


def parse_json_call(body: str) -> ParsedToolCall:
    """Hermes/Qwen JSON body ``{"name": ..., "arguments": {...}}``. Raises ValueError."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool call is not valid JSON: {exc.msg} at {exc.pos}") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("tool call JSON must be an object with a non-empty string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"tool call arguments string is not JSON: {exc.msg}") from exc
    if not isinstance(args, dict):
        raise ValueError("tool call 'arguments' must be a JSON object")
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_xml_call(body: str, tools: list[dict[str, Any]] | None = None) -> ParsedToolCall:
    """qwen3_coder XML body. Values are typed by the tool's JSON schema when known."""
    match = _FUNCTION.search(body)
    if match is None:
        raise ValueError("tool call has no <function=NAME> element")
    name = match.group(1).strip()
    if not name:
        raise ValueError("tool call function name is empty")
    schema = _parameter_types(tools, name)
    args = {}
    for pname, raw in _PARAMETER.findall(match.group(2)):
        pname = pname.strip()
        args[pname] = _typed_value(_trim_newline(raw), schema.get(pname))
    return ParsedToolCall(name, json.dumps(args, ensure_ascii=False))


def parse_tool_call(body: str, tools: list[dict[str, Any]] | None = None) -> ParsedToolCall:
    """One ``<tool_call>`` body in either format. Raises ValueError when malformed."""
    stripped = body.strip()
    if stripped.startswith("<function="):
        return parse_xml_call(stripped, tools)
    return parse_json_call(stripped)


def parse_reply(text: str, tools: list[dict[str, Any]] | None = None) -> ParsedReply:
    """Split generated text (special tokens already removed) into reasoning, content and
    tool calls. Unparseable ``<tool_call>`` blocks stay in content and are listed in errors."""
    reasoning, rest = split_reasoning(text)
    calls: list[ParsedToolCall] = []
    errors: list[str] = []
    kept: list[str] = []
    cursor = 0
    for match in _BLOCK.finditer(rest):
        kept.append(rest[cursor : match.start()])
        cursor = match.end()
        closed = match.group(0).endswith(TOOL_CALL_CLOSE)
        try:
            if not closed:
                raise ValueError("unterminated <tool_call> block")
            calls.append(parse_tool_call(match.group(1), tools))
        except ValueError as exc:
            errors.append(str(exc))
            kept.append(match.group(0))
    kept.append(rest[cursor:])
    content = "".join(kept).strip() if calls else "".join(kept)
    return ParsedReply(content=content, reasoning=reasoning, tool_calls=calls, errors=errors)


def _trim_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _parameter_types(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def _typed_value(raw: str, json_type: Any) -> Any:
    """Convert an XML parameter's text by its schema type; unknown types stay strings,
    and a value that does not parse as its declared type is kept verbatim."""
    if json_type in (None, "string") or isinstance(json_type, list):
        return raw
    text = raw.strip()
    try:
        if json_type == "integer":
            return int(text)
        if json_type == "number":
            number = float(text)
            return int(number) if number.is_integer() and "." not in text else number
        if json_type == "boolean":
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
            return raw
        if json_type in ("object", "array", "null"):
            return json.loads(text)
    except ValueError:
        return raw
    return raw
