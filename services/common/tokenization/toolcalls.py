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
    id: str = ""  # the call's id where the model wrote one (Mistral's); else the caller's


class ToolCallFailure(Struct, frozen=True):
    """A piece of the model's tool markup that did not become a tool call.

    ``kind``: ``malformed`` (the markup does not parse: bad JSON or XML, unterminated),
    ``unknown_tool`` (a name the request did not offer), ``invalid_arguments`` (arguments
    that do not match the tool's JSON schema). ``start``/``end``: character offsets into
    the text the parser read (the decoded output), turned into token offsets by the
    caller that knows the ids (``ChatTokenizer.parse_reply``)."""

    kind: str
    detail: str
    start: int
    end: int


class ParsedReply(Struct, frozen=True):
    content: str
    reasoning: str | None
    tool_calls: list[ParsedToolCall]
    errors: list[str]
    failures: list[ToolCallFailure] = []


def split_reasoning(text: str, reasoning_open: bool = False) -> tuple[str | None, str]:
    """(reasoning, rest). Reasoning is what precedes ``</think>`` (an opening tag optional);
    an unclosed ``<think>`` at the start makes the whole remainder reasoning (truncated),
    and so does output without ``</think>`` when the prompt opened the block
    (``reasoning_open``: Qwen3.5's generation prompt ends with ``<think>\n``)."""
    stripped = text.lstrip()
    if THINK_CLOSE in text:
        head, _, rest = text.partition(THINK_CLOSE)
        head = head.lstrip()
        if head.startswith(THINK_OPEN):
            head = head[len(THINK_OPEN) :]
        return head.strip("\n"), rest.lstrip("\n")
    if stripped.startswith(THINK_OPEN):
        return stripped[len(THINK_OPEN) :].strip("\n"), ""
    if reasoning_open:
        return text.strip("\n"), ""
    return None, text


def json_arguments_call(name: str, raw: str) -> ParsedToolCall:
    """A call of ``name`` whose arguments are the JSON object text ``raw`` (empty: none).
    Raises ValueError when it is not one."""
    try:
        args = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"tool call arguments are not valid JSON: {exc.msg} (character {exc.pos})"
        ) from exc
    return object_arguments_call(name, args)


def object_arguments_call(name: str, args: Any) -> ParsedToolCall:
    """A call of ``name`` with ``args`` already decoded. Raises ValueError unless an object."""
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return ParsedToolCall(name, json.dumps(args, ensure_ascii=False))


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


def parse_reply(
    text: str, tools: list[dict[str, Any]] | None = None, *, reasoning_open: bool = False
) -> ParsedReply:
    """Split generated text (special tokens already removed) into reasoning, content and
    tool calls (``<tool_call>`` blocks, JSON or XML). Unparseable blocks stay in content
    and are listed in errors and failures (with their place in ``text``)."""
    reasoning, rest = split_reasoning(text, reasoning_open)
    offset = len(text) - len(rest)  # where ``rest`` starts in ``text``
    calls: list[ParsedToolCall] = []
    errors: list[str] = []
    failures: list[ToolCallFailure] = []
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
            failures.append(
                ToolCallFailure("malformed", str(exc), offset + match.start(), offset + match.end())
            )
            kept.append(match.group(0))
    kept.append(rest[cursor:])
    content = "".join(kept).strip() if calls else "".join(kept)
    return ParsedReply(
        content=content, reasoning=reasoning, tool_calls=calls, errors=errors, failures=failures
    )


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
