"""What one model family needs beyond its tokenizer and chat template.

A ``ModelFamily`` says how the family's official template wants messages (tool-call
arguments as mappings, where the reasoning goes), how a protocol's reasoning settings
become template variables (``enable_thinking``, ``reasoning_effort``, ``thinking``), which
texts end an assistant turn in a rendered history, and how to read the model's raw output
into reasoning, content and tool calls, as the engines' own parsers do. Everything here
is pure: the proxy and the embedded engine call it through ``ChatTokenizer``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from services.common.tokenization.lru import SizedLRU
from services.common.tokenization.toolcalls import ParsedReply, ToolCallFailure

# parse(text, tools, reasoning_open=...) -> ParsedReply: the decoded output (special
# tokens kept, the closing end-of-turn ids removed); ``reasoning_open``: the prompt ended
# inside a reasoning block (a generation prompt that opens ``<think>``)
ReplyParser = Callable[..., ParsedReply]


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    name: str
    parse: ReplyParser
    # the key the template reads an assistant message's reasoning from
    reasoning_key: str = "reasoning_content"
    # tool-call arguments reach the template as mappings (what transformers documents
    # and vLLM and SGLang do before templating); Polar's own template takes either
    arguments_as_mapping: bool = True
    # texts that end an assistant turn (or a message) in a rendered history; () = the
    # tokenizer's end-of-sequence tokens
    turn_ends: tuple[str, ...] = ()
    # template variables that carry a protocol's reasoning settings
    thinking_kwarg: str | None = None  # a bool: thinking on or off
    effort_kwarg: str | None = None  # low / medium / high
    efforts: tuple[str, ...] = ("low", "medium", "high")
    # a generation prompt ending in one of these leaves the model inside its reasoning
    reasoning_open_suffixes: tuple[str, ...] = ()
    # a system message after the conversation started, which the template refuses
    # (Qwen3.5), drops (gpt-oss) or moves to the front (DeepSeek, Mistral), is rendered
    # as a user turn in its place: Claude Code sends one with its first call
    late_system_as_user: bool = False
    # ids of tool calls and results as the template requires them (Mistral: exactly 9
    # letters or digits); None: as sent
    tool_call_id_length: int | None = None
    # every tool has a description (gpt-oss's template writes "// " + tool.description;
    # the proxy leaves an empty one out)
    tool_description_required: bool = False
    known: bool = True  # False: a model no family matched (generic parsing, a warning)
    notes: str = ""  # one line for docs and the warning

    def prepare(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` (OpenAI chat dicts) as the family's template reads them. The input
        is not changed; messages that need nothing are passed through as they are."""
        plain = self.reasoning_key == "reasoning_content" and self.tool_call_id_length is None
        if not self.arguments_as_mapping and plain and not self.late_system_as_user:
            return messages
        out: list[dict[str, Any]] = []
        for message in messages:
            role = message.get("role")
            if role == "assistant":
                message = self._assistant(message)
            elif self.tool_call_id_length and role == "tool":
                message = self._tool_result(message)
            elif self.late_system_as_user and role in SYSTEM_ROLES and _started(out):
                message = {**message, "role": "user"}
            out.append(message)
        return out

    def prepare_tools(self, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """``tools`` as the family's template reads them (unchanged unless it must be)."""
        if not tools or not self.tool_description_required:
            return tools
        if all("description" in t.get("function", t) for t in tools):
            return tools
        return [_described(t) for t in tools]

    def _tool_result(self, message: dict[str, Any]) -> dict[str, Any]:
        call_id = message.get("tool_call_id")
        fitted = fit_id(call_id, self.tool_call_id_length) if isinstance(call_id, str) else call_id
        return message if fitted == call_id else {**message, "tool_call_id": fitted}

    def _assistant(self, message: dict[str, Any]) -> dict[str, Any]:
        calls = message.get("tool_calls")
        moved = self.reasoning_key != "reasoning_content" and "reasoning_content" in message
        mapped = self.arguments_as_mapping and calls and any(_is_text_args(c) for c in calls)
        refit = bool(calls) and self.tool_call_id_length is not None
        if not moved and not mapped and not refit:
            return message
        message = dict(message)
        if moved:
            reasoning = message.pop("reasoning_content")
            if reasoning:
                message[self.reasoning_key] = reasoning
        if mapped:
            message["tool_calls"] = [_with_mapping_args(c) for c in calls]
        if refit:
            message["tool_calls"] = [
                {**c, "id": fit_id(c["id"], self.tool_call_id_length)}
                if isinstance(c.get("id"), str)
                else c
                for c in message["tool_calls"]
            ]
        return message

    def template_kwargs(
        self, reasoning: Any | None, explicit: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Template variables for a request: its protocol's reasoning settings (an object
        with ``enabled`` and ``effort``, e.g. ``proxy.conversation.Reasoning``) in the
        family's own words, then ``explicit`` (OpenAI's ``chat_template_kwargs``), which
        wins."""
        out: dict[str, Any] = {}
        if reasoning is not None:
            enabled = getattr(reasoning, "enabled", None)
            effort = getattr(reasoning, "effort", None)
            if effort in ("none", "minimal") and enabled is None:
                enabled = False  # OpenAI's "none": no reasoning at all
            if self.thinking_kwarg and enabled is not None:
                out[self.thinking_kwarg] = bool(enabled)
            elif self.thinking_kwarg and effort in self.efforts:
                out[self.thinking_kwarg] = True
            if self.effort_kwarg and effort:
                out[self.effort_kwarg] = _nearest_effort(effort, self.efforts)
        if explicit:
            out.update(explicit)
        return out

    def reasoning_open(self, prompt_text_tail: str) -> bool:
        """Whether a prompt ending in ``prompt_text_tail`` leaves the model reasoning."""
        return any(prompt_text_tail.endswith(s) for s in self.reasoning_open_suffixes)


SYSTEM_ROLES = ("system", "developer")


def _described(tool: dict[str, Any]) -> dict[str, Any]:
    if "function" in tool:
        fn = tool["function"]
        return tool if "description" in fn else {**tool, "function": {**fn, "description": ""}}
    return tool if "description" in tool else {**tool, "description": ""}


def _started(before: list[dict[str, Any]]) -> bool:
    """A message other than system ones came before: the conversation has started."""
    return any(m.get("role") not in SYSTEM_ROLES for m in before)


def fit_id(call_id: str, length: int) -> str:
    """``call_id`` as an id of exactly ``length`` letters or digits: itself if it is one,
    else its last ``length`` characters if those are (as vLLM cuts ids for Mistral), else
    a digest of it. The same id always maps the same way, so a call and its result agree."""
    if len(call_id) == length and call_id.isascii() and call_id.isalnum():
        return call_id
    tail = call_id[-length:]
    if len(tail) == length and tail.isascii() and tail.isalnum():
        return tail
    return hashlib.sha1(call_id.encode()).hexdigest()[:length]


def _nearest_effort(effort: str, efforts: tuple[str, ...]) -> str:
    if effort in efforts:
        return effort
    # OpenAI's scale around the family's: minimal/none -> lowest, xhigh/max -> highest
    return efforts[0] if effort in ("none", "minimal") else efforts[-1]


def _is_text_args(call: dict[str, Any]) -> bool:
    fn = call.get("function", call)
    return isinstance(fn, dict) and isinstance(fn.get("arguments"), str)


# Arguments JSON by its text: a long session's history holds every past call's arguments,
# parsed again at each render of each call
_parsed_args: SizedLRU[str, Any] = SizedLRU(8_000_000, lambda text, _v: 2 * len(text) + 64)
_UNPARSED = object()


def arguments_mapping(text: str) -> Any:
    """The arguments JSON text as a mapping; text that is not a JSON object stays text
    (the template gets what the model wrote)."""
    hit = _parsed_args.get(text)
    if hit is None:
        try:
            value = json.loads(text) if text.strip() else {}
        except ValueError:
            value = _UNPARSED
        if not isinstance(value, dict):
            value = _UNPARSED
        _parsed_args.put(text, value)
        hit = value
    return text if hit is _UNPARSED else hit


def _with_mapping_args(call: dict[str, Any]) -> dict[str, Any]:
    if not _is_text_args(call):
        return call
    call = dict(call)
    if "function" in call:
        fn = dict(call["function"])
        fn["arguments"] = arguments_mapping(fn["arguments"])
        call["function"] = fn
    else:
        call["arguments"] = arguments_mapping(call["arguments"])
    return call


# -- checks every family shares ---------------------------------------------------------
def tool_names(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Offered tools by name: their JSON schema (``parameters``)."""
    out = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") or {}
    return out


def check_calls(parsed: ParsedReply, tools: list[dict[str, Any]] | None) -> ParsedReply:
    """``parsed`` with a failure for each call of a tool not offered, or with arguments
    that break the tool's schema (its required properties and their JSON types). The calls
    stay in the reply: the harness decides what to do with them, as it would with any
    engine's parser; the failure is for parse health."""
    if not parsed.tool_calls or tools is None:
        return parsed
    offered = tool_names(tools)
    failures = list(parsed.failures)
    for call in parsed.tool_calls:
        if call.name not in offered:
            failures.append(ToolCallFailure("unknown_tool", f"no tool named {call.name!r}", -1, -1))
            continue
        problem = schema_problem(call.arguments, offered[call.name])
        if problem:
            failures.append(ToolCallFailure("invalid_arguments", f"{call.name}: {problem}", -1, -1))
    if len(failures) == len(parsed.failures):
        return parsed
    return ParsedReply(
        content=parsed.content,
        reasoning=parsed.reasoning,
        tool_calls=parsed.tool_calls,
        errors=parsed.errors,
        failures=failures,
    )


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def _kinds(wanted: Any) -> tuple[type, ...]:
    names = wanted if isinstance(wanted, list) else []
    return tuple(t for n in names if isinstance(n, str) for t in _JSON_TYPES.get(n, ()))


_KINDS = {name: kinds for name, kinds in _JSON_TYPES.items()}  # one type name: no tuple built


def schema_problem(arguments: str, schema: dict[str, Any]) -> str | None:
    """What is wrong with ``arguments`` (JSON text) for ``schema``: not an object, a
    required property missing, a property of the wrong JSON type; None when it fits. The
    top level only: what every engine's parser and harness checks before running a tool."""
    try:
        args = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError:
        return "arguments are not JSON"
    if not isinstance(args, dict):
        return "arguments are not a JSON object"
    if not isinstance(schema, dict):
        return None
    missing = [k for k in schema.get("required") or [] if k not in args]
    if missing:
        return f"missing required {', '.join(map(str, missing))}"
    props = schema.get("properties") or {}
    for key, value in args.items():
        spec = props.get(key)
        if not isinstance(spec, dict):
            if schema.get("additionalProperties") is False:
                return f"unexpected property {key!r}"
            continue
        wanted = spec.get("type")
        kinds = _KINDS.get(wanted) if isinstance(wanted, str) else _kinds(wanted)
        if not kinds:
            continue
        bad_bool = isinstance(value, bool) and bool not in kinds  # True is an int in Python
        if bad_bool or not isinstance(value, kinds):
            names = wanted if isinstance(wanted, list) else [wanted]
            return f"{key!r} is not of type {'/'.join(map(str, names))}"
    return None
