"""OpenAI Responses ``input`` items -> system text and normalized messages.

Items of one model turn (reasoning, an assistant message, function / custom tool calls)
are merged back into one assistant message, so a chat template sees the turn as the
model produced it. Tool outputs become ``tool`` messages. Items with no place in a
prompt (item references, hosted-tool calls, compaction blobs) are dropped and counted;
an ``input_file`` part, or an ``input_image`` by ``file_id`` only, is meant to be read,
so it is a 400 naming the field instead.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.conversation import (
    ImagePart,
    Message,
    Part,
    ReasoningPart,
    TextPart,
    ToolCall,
    join_system,
)
from proxy.errors import ProtocolError
from proxy.protocols.base import as_dict, bad, json_text, opt_str, req_str

SYSTEM_ROLES = ("system", "developer")
OUTPUT_TYPES = (
    "function_call_output",
    "custom_tool_call_output",
    "local_shell_call_output",
    "mcp_call_output",
)


def parse_input(v: Any, instructions: str) -> tuple[str, list[Message], list[str]]:
    """(system text, messages, types of dropped items)."""
    b = _Builder([instructions] if instructions else [])
    if isinstance(v, str):
        b.messages.append(Message(role="user", content=[TextPart(v)]))
    elif isinstance(v, list):
        for i, item in enumerate(v):
            b.add(as_dict(item, f"input[{i}]"), f"input[{i}].")
    else:
        raise bad("input must be a string or an array of items", "input")
    b.flush()
    return join_system(b.system), b.messages, b.dropped


class _Builder:
    def __init__(self, system: list[str]) -> None:
        self.system = system
        self.messages: list[Message] = []
        self.dropped: list[str] = []
        self.parts: list[Part] = []  # the assistant turn being assembled
        self.calls: list[ToolCall] = []

    def flush(self) -> None:
        if self.parts or self.calls:
            self.messages.append(
                Message(role="assistant", content=self.parts, tool_calls=self.calls)
            )
            self.parts, self.calls = [], []

    def add(self, item: dict[str, Any], at: str) -> None:
        kind = item.get("type")
        if kind == "message" or (kind is None and "role" in item):
            self.message(item, at)
        elif kind == "reasoning":
            self.reasoning(item)
        elif kind == "function_call":
            call_id = opt_str(item, "call_id", at) or opt_str(item, "id", at) or ""
            self.calls.append(
                ToolCall(call_id, req_str(item, "name", at), json_text(item.get("arguments")))
            )
        elif kind == "custom_tool_call":
            text = opt_str(item, "input", at) or ""
            args = orjson.dumps({"input": text}).decode()
            self.calls.append(
                ToolCall(req_str(item, "call_id", at), req_str(item, "name", at), args)
            )
        elif kind == "local_shell_call":
            call_id = opt_str(item, "call_id", at) or opt_str(item, "id", at) or ""
            self.calls.append(ToolCall(call_id, "local_shell", json_text(item.get("action"))))
        elif kind in OUTPUT_TYPES:
            self.tool_output(item, at)
        else:
            self.dropped.append(str(kind))

    def message(self, item: dict[str, Any], at: str) -> None:
        role = req_str(item, "role", at)
        content = parse_content(item.get("content"), at + "content")
        if role == "assistant":
            if self.calls:
                self.flush()
            self.parts.extend(content)
            return
        self.flush()
        if role in SYSTEM_ROLES:
            text = join_system([_text(content)])
            if self.messages:
                self.messages.append(Message(role="system", content=[TextPart(text)]))
            else:
                self.system.append(text)
        elif role == "user":
            self.messages.append(Message(role="user", content=content))
        else:
            raise bad(
                f"{at}role {role!r} is not one of user, assistant, system, developer", at + "role"
            )

    def reasoning(self, item: dict[str, Any]) -> None:
        if self.calls or any(not isinstance(p, ReasoningPart) for p in self.parts):
            self.flush()  # reasoning opens a new turn
        text = _reasoning_text(item)
        if text:
            self.parts.append(ReasoningPart(text))

    def tool_output(self, item: dict[str, Any], at: str) -> None:
        self.flush()
        output = item.get("output")
        content = (
            parse_content(output, at + "output")
            if isinstance(output, str | list)
            else _json_part(output)
        )
        self.messages.append(
            Message(role="tool", content=content, tool_call_id=req_str(item, "call_id", at))
        )


def parse_content(v: Any, where: str) -> list[Part]:
    if v is None:
        return []
    if isinstance(v, str):
        return [TextPart(v)]
    if not isinstance(v, list):
        raise bad(f"{where} must be a string or an array of content parts", where)
    parts: list[Part] = []
    for i, item in enumerate(v):
        p = as_dict(item, f"{where}[{i}]")
        kind = p.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            parts.append(TextPart(req_str(p, "text", f"{where}[{i}].")))
        elif kind == "refusal":
            parts.append(TextPart(opt_str(p, "refusal", f"{where}[{i}].") or ""))
        elif kind == "input_image":
            parts.append(ImagePart(_image_url(p, f"{where}[{i}].")))
        elif kind == "input_file":
            raise _file_refused(p, f"{where}[{i}].")
    return parts


def _image_url(p: dict[str, Any], at: str) -> str:
    """An ``input_image``'s URL. Polar has no files API, so an image named only by
    ``file_id`` cannot be resolved: a 400 naming the field, never a silently
    dropped image (the model would answer about a picture it never saw)."""
    url = opt_str(p, "image_url", at)
    if url:
        return url
    if p.get("file_id") is not None:
        raise bad(
            f"{at}file_id: input_image.file_id is not supported (Polar has no files API): "
            "send the image's bytes in image_url as a data: URL (data:<type>;base64,...)",
            at + "file_id",
        )
    raise bad(f"{at}image_url is required for an input_image", at + "image_url")


def _file_refused(p: dict[str, Any], at: str) -> ProtocolError:
    """An ``input_file``, however given: Polar has no files API and the prompt holds text
    and images only, so it is a 400 naming the field, never a file silently left out."""
    given = next((k for k in ("file_id", "file_data", "file_url") if p.get(k) is not None), "")
    field = at + (given or "type")
    return bad(
        f"{field}: input_file is not supported (Polar has no files API and the prompt "
        "holds text and images only): send the file's text as an input_text part",
        field,
    )


def _reasoning_text(item: dict[str, Any]) -> str:
    """Raw reasoning if the item has it, else its summary."""
    for key in ("content", "summary"):
        blocks = item.get(key)
        if isinstance(blocks, list):
            texts = [
                b["text"] for b in blocks if isinstance(b, dict) and isinstance(b.get("text"), str)
            ]
            if texts:
                return "\n\n".join(texts)
    return ""


def _text(parts: list[Part]) -> str:
    return "\n".join(p.text for p in parts if isinstance(p, TextPart))


def _json_part(value: Any) -> list[Part]:
    return [] if value is None else [TextPart(orjson.dumps(value).decode())]
