"""Anthropic ``system`` and ``messages`` -> system text and normalized messages.

``system`` blocks and leading ``role: "system"`` messages form the system text (Claude
Code's billing-header line removed); later ``role: "system"`` messages stay in place.
A user message's ``tool_result`` blocks become ``tool`` messages, in order; its other
blocks stay a user message. A ``document`` with a text or content source becomes text
parts; one the prompt cannot hold (a PDF's bytes, a URL, a Files API file) is a 400
naming its source, as an image by ``file`` is. Blocks with no place in a prompt
(redacted thinking, server tool results) are dropped and counted.
"""

from __future__ import annotations

from typing import Any

from proxy.conversation import (
    ImagePart,
    Message,
    Part,
    ReasoningPart,
    TextPart,
    ToolCall,
    join_system,
    text_of,
)
from proxy.protocols.base import as_dict, bad, data_url, json_text, opt_str, req_str


def system_texts(v: Any) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list):
        raise bad("system must be a string or an array of text blocks", "system")
    return [req_str(as_dict(b, f"system[{i}]"), "text", f"system[{i}].") for i, b in enumerate(v)]


def parse_messages(raw: list[Any], system: list[str]) -> tuple[str, list[Message], list[str]]:
    messages: list[Message] = []
    dropped: list[str] = []
    for i, item in enumerate(raw):
        m, at = as_dict(item, f"messages[{i}]"), f"messages[{i}]."
        role = req_str(m, "role", at)
        blocks = content_blocks(m.get("content"), at + "content")
        if role == "system":
            text = join_system([text_of(user_parts(blocks, at, dropped))])
            if messages:
                messages.append(Message(role="system", content=[TextPart(text)]))
            else:
                system.append(text)
        elif role == "user":
            messages.extend(user_messages(blocks, at, dropped))
        elif role == "assistant":
            messages.append(assistant_message(blocks, at, dropped))
        else:
            raise bad(f"{at}role {role!r} is not one of user, assistant, system", at + "role")
    return join_system(system), messages, dropped


def content_blocks(v: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(v, str):
        return [{"type": "text", "text": v}]
    if not isinstance(v, list):
        raise bad(f"{where} must be a string or an array of content blocks", where)
    return [as_dict(b, f"{where}[{i}]") for i, b in enumerate(v)]


def user_messages(blocks: list[dict[str, Any]], at: str, dropped: list[str]) -> list[Message]:
    out: list[Message] = []
    pending: list[dict[str, Any]] = []
    for i, b in enumerate(blocks):
        if b.get("type") != "tool_result":
            pending.append(b)
            continue
        if parts := user_parts(pending, at, dropped):
            out.append(Message(role="user", content=parts))
        pending = []
        out.append(tool_message(b, f"{at}content[{i}].", dropped))
    parts = user_parts(pending, at, dropped)
    if parts or not out:  # blocks we cannot show leave no empty user message behind
        out.append(Message(role="user", content=parts))
    return out


def tool_message(b: dict[str, Any], at: str, dropped: list[str]) -> Message:
    content = b.get("content")
    if content is None:
        parts: list[Part] = []
    else:
        parts = user_parts(content_blocks(content, at + "content"), at, dropped)
    return Message(
        role="tool",
        content=parts,
        tool_call_id=req_str(b, "tool_use_id", at),
        is_error=b.get("is_error") is True,
    )


def user_parts(blocks: list[dict[str, Any]], at: str, dropped: list[str]) -> list[Part]:
    parts: list[Part] = []
    for i, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "text":
            parts.append(TextPart(req_str(b, "text", at + "content[].")))
        elif kind == "image":
            parts.append(ImagePart(image_url(b.get("source"), f"{at}content[{i}].source")))
        elif kind == "document":
            parts.extend(document_parts(b, f"{at}content[{i}].", dropped))
        else:
            dropped.append(str(kind))
    return parts


def image_url(source: Any, at: str) -> str:
    """An image block's URL. One the proxy cannot read (a Files API ``file`` source: Polar
    has no files API) is a 400 naming it, never an image silently left out."""
    src = as_dict(source, at)
    kind = src.get("type")
    if kind == "base64":
        media = opt_str(src, "media_type", at + ".") or ""
        return data_url(media, req_str(src, "data", at + "."))
    if kind == "url":
        return req_str(src, "url", at + ".")
    if kind == "file":
        raise bad(
            f"{at}: an image source of type 'file' is not supported (Polar has no files API): "
            "send the image's bytes as a base64 source",
            at + ".file_id",
        )
    raise bad(f"{at}.type must be 'base64' or 'url', not {kind!r}", at + ".type")


# document sources the prompt cannot hold, and why
UNREADABLE_DOCUMENTS = {
    "base64": "the prompt holds text and images, not PDFs",
    "url": "nothing here fetches URLs",
    "file": "Polar has no files API",
}


def document_parts(b: dict[str, Any], at: str, dropped: list[str]) -> list[Part]:
    """A document block's text, after a line with its title and context if it has them.
    Any other source is a 400 naming it, never a document silently left out (the model
    would answer about a document it never read)."""
    where = at + "source"
    src = as_dict(b.get("source"), where)
    kind = src.get("type")
    if kind == "text":
        body: list[Part] = [TextPart(req_str(src, "data", where + "."))]
    elif kind == "content":
        blocks = content_blocks(src.get("content"), where + ".content")
        body = user_parts(blocks, where + ".", dropped)
    elif isinstance(kind, str) and kind in UNREADABLE_DOCUMENTS:
        raise bad(
            f"{where}: a document source of type {kind!r} is not supported "
            f"({UNREADABLE_DOCUMENTS[kind]}): send the document's text as a text source "
            '({"type": "text", "media_type": "text/plain", "data": "..."})',
            where,
        )
    else:
        raise bad(f"{where}.type must be 'text' or 'content', not {kind!r}", where + ".type")
    heading = [t for t in (opt_str(b, "title", at), opt_str(b, "context", at)) if t]
    return [TextPart("\n".join(heading)), *body] if heading else body


def assistant_message(blocks: list[dict[str, Any]], at: str, dropped: list[str]) -> Message:
    parts: list[Part] = []
    calls: list[ToolCall] = []
    for i, b in enumerate(blocks):
        kind, where = b.get("type"), f"{at}content[{i}]."
        if kind == "text":
            parts.append(TextPart(req_str(b, "text", where)))
        elif kind == "thinking":
            parts.append(
                ReasoningPart(req_str(b, "thinking", where), opt_str(b, "signature", where) or "")
            )
        elif kind == "tool_use":
            args = json_text(b.get("input"))
            calls.append(ToolCall(req_str(b, "id", where), req_str(b, "name", where), args))
        else:
            dropped.append(str(kind))
    return Message(role="assistant", content=parts, tool_calls=calls)
