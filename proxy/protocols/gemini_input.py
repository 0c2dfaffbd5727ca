"""Gemini ``contents`` / ``systemInstruction`` / schemas -> the normalized conversation.

Field names are read in camelCase or snake_case (the REST API accepts both). A
``functionCall`` without an id gets one, and a ``functionResponse`` without an id answers
the oldest open call of the same name. ``parameters`` (OpenAPI-style, upper-case types)
become JSON schema; ``parametersJsonSchema`` is taken as is. ``inlineData`` of a text/*
type is read as its UTF-8 text; otherwise ``inlineData`` / ``fileData`` must be images:
any other media type is a 400 naming the field; parts with no place in a prompt are
dropped and counted.
"""

from __future__ import annotations

import base64
import binascii
import re
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
from proxy.protocols.base import as_dict, bad, data_url, json_text, req_str

_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")
USER_ROLES = (None, "", "user", "function")  # "function": older clients' functionResponse turns


def get(d: dict[str, Any], camel: str) -> Any:
    if camel in d:
        return d[camel]
    return d.get(_CAMEL.sub("_", camel).lower())


def system_text(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    parts = get(as_dict(v, "systemInstruction"), "parts")
    if not isinstance(parts, list):
        raise bad("systemInstruction.parts must be an array", "systemInstruction.parts")
    texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return join_system(["\n".join(texts)])


def parse_contents(raw: list[Any]) -> tuple[list[Message], list[str]]:
    reader = _Reader()
    for i, item in enumerate(raw):
        c = as_dict(item, f"contents[{i}]")
        parts = get(c, "parts")
        if not isinstance(parts, list):
            raise bad(f"contents[{i}].parts must be an array", f"contents[{i}].parts")
        at = f"contents[{i}]."
        role = c.get("role")
        if role == "model":
            reader.model_turn(parts, at)
        elif role in USER_ROLES:
            reader.user_turn(parts, at)
        else:  # e.g. "assistant" from an OpenAI-shaped client: never silently a user turn
            raise bad(f"{at}role must be 'user' or 'model', got {role!r}", at + "role")
    return reader.messages, reader.dropped


class _Reader:
    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.dropped: list[str] = []
        self.open_calls: list[ToolCall] = []  # calls not answered yet, oldest first
        self.n_calls = 0

    def model_turn(self, parts: list[Any], at: str) -> None:
        content: list[Part] = []
        calls: list[ToolCall] = []
        for j, raw in enumerate(parts):
            p, where = as_dict(raw, f"{at}parts[{j}]"), f"{at}parts[{j}]."
            fc = get(p, "functionCall")
            if isinstance(fc, dict):
                calls.append(self.call(fc, where + "functionCall."))
            elif p.get("text") is not None:
                text = req_str(p, "text", where)  # a text that is no string is a 400
                content.append(ReasoningPart(text) if p.get("thought") else TextPart(text))
            else:
                self.media(p, content, where)
        self.messages.append(Message(role="assistant", content=content, tool_calls=calls))

    def call(self, fc: dict[str, Any], where: str) -> ToolCall:
        call_id = (
            fc.get("id")
            if isinstance(fc.get("id"), str) and fc.get("id")
            else f"call_{self.n_calls}"
        )
        self.n_calls += 1
        call = ToolCall(call_id, req_str(fc, "name", where), json_text(fc.get("args")))
        self.open_calls.append(call)
        return call

    def user_turn(self, parts: list[Any], at: str) -> None:
        pending: list[Part] = []
        for j, raw in enumerate(parts):
            p, where = as_dict(raw, f"{at}parts[{j}]"), f"{at}parts[{j}]."
            fr = get(p, "functionResponse")
            if isinstance(fr, dict):
                if pending:
                    self.messages.append(Message(role="user", content=pending))
                    pending = []
                self.messages.append(self.result(fr, where + "functionResponse."))
            elif p.get("text") is not None:
                pending.append(TextPart(req_str(p, "text", where)))
            else:
                self.media(p, pending, where)
        if pending or not parts:
            self.messages.append(Message(role="user", content=pending))

    def result(self, fr: dict[str, Any], where: str) -> Message:
        name = req_str(fr, "name", where)
        given = fr.get("id") if isinstance(fr.get("id"), str) else ""
        match = next(
            (c for c in self.open_calls if (c.id == given if given else c.name == name)), None
        )
        if match is not None:
            self.open_calls.remove(match)
        call_id = given or (match.id if match else "")
        return Message(
            role="tool", content=response_parts(fr.get("response")), tool_call_id=call_id, name=name
        )

    def media(self, p: dict[str, Any], out: list[Part], at: str) -> None:
        inline, file = get(p, "inlineData"), get(p, "fileData")
        if isinstance(inline, dict) and isinstance(inline.get("data"), str):
            if is_text(inline):  # a text file sent as bytes: the model reads its text
                out.append(TextPart(inline_text(inline, at + "inlineData")))
                return
            mime = image_type(inline, at + "inlineData")
            out.append(ImagePart(data_url(mime, inline["data"])))
        elif isinstance(file, dict) and isinstance(get(file, "fileUri"), str):
            image_type(file, at + "fileData")
            out.append(ImagePart(get(file, "fileUri")))
        elif p:
            self.dropped.append(next(iter(p)))


def is_text(blob: dict[str, Any]) -> bool:
    return str(get(blob, "mimeType") or "").lower().startswith("text/")


def inline_text(blob: dict[str, Any], at: str) -> str:
    """A text/* inline part's text: its base64 data decoded as UTF-8 (a 400 naming the
    field when it is not)."""
    try:
        return base64.b64decode(blob["data"], validate=True).decode("utf-8")
    except (binascii.Error, ValueError) as exc:
        raise bad(f"{at}.data is not base64 of UTF-8 text ({exc})", at + ".data") from exc


def image_type(blob: dict[str, Any], at: str) -> str:
    """An inline or file part's media type. The prompt holds text and images only: a
    document, sound or video is a 400 naming the field, never a part passed on as an
    image or left out. No type at all is left to the bytes to decide, as before."""
    mime = str(get(blob, "mimeType") or "")
    if mime and not mime.lower().startswith("image/"):
        raise bad(
            f"{at}.mimeType {mime!r} is not supported (the prompt holds text and images "
            "only): send a document's text as a text part, an image as image/*",
            at + ".mimeType",
        )
    return mime


def response_parts(response: Any) -> list[Part]:
    """A function's response object as tool-result text: its lone ``output`` string when
    that is all it has (the Gemini CLI's usual shape), else the JSON."""
    if response is None:
        return []
    if (
        isinstance(response, dict)
        and set(response) == {"output"}
        and isinstance(response["output"], str)
    ):
        return [TextPart(response["output"])]
    return [TextPart(orjson.dumps(response).decode())]


def schema_to_json_schema(schema: Any) -> Any:
    """Gemini ``Schema`` (type: "OBJECT", nullable, …) -> JSON schema (type: "object")."""
    if isinstance(schema, list):
        return [schema_to_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            out["type"] = value.lower()
        elif key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {k: schema_to_json_schema(v) for k, v in value.items()}
        elif key == "nullable":
            continue
        else:
            out[_snake_to_camel_schema_key(key)] = schema_to_json_schema(value)
    if schema.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _snake_to_camel_schema_key(key: str) -> str:
    """The SDK's snake_case schema keys (any_of, max_items) back to JSON-schema names."""
    if "_" not in key or key.startswith("$"):
        return key
    head, *rest = key.split("_")
    return head + "".join(w.capitalize() for w in rest)
