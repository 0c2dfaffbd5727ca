"""Input the user means the model to read: read as text where it is text, refused with a
400 naming the field where the prompt cannot hold it (a PDF, a file, a sound), never
silently left out. What has no place in a prompt stays dropped and counted."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from proxy.conversation import Conversation, ImagePart, TextPart
from proxy.errors import ProtocolError
from proxy.protocols import PROTOCOLS

SPECS = {p.name: p for p in PROTOCOLS}
GEMINI_ROUTE = {"target": "m:generateContent"}

PDF = {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQK"}
ASK = {"type": "text", "text": "summarize it"}


def parse(protocol: str, body: dict[str, Any]) -> Conversation:
    spec = SPECS[protocol]
    assert spec.parse_request is not None
    return spec.parse_request(body, GEMINI_ROUTE if protocol == "gemini" else {}, {})


def anthropic(*content: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": list(content)}]}


def responses(*items: Any) -> dict[str, Any]:
    return {"model": "m", "input": list(items)}


def chat(*messages: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages)}


def gemini(*contents: Any) -> dict[str, Any]:
    return {"contents": list(contents)}


def document(source: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "document", "source": source, **extra}


def tool_result(*content: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": "t1", "content": list(content)}


INPUT_TEXT = {"type": "input_text", "text": "summarize it"}
FILE_DATA = {
    "type": "input_file",
    "filename": "a.pdf",
    "file_data": "data:application/pdf;base64,J",
}
CHAT_FILE = {"type": "file", "file": {"file_id": "file-abc"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
PDF_INLINE = {"inlineData": {"mimeType": "application/pdf", "data": "JVBERi0xLjQK"}}

# (protocol, request body, the field the 400 names, words its message says)
REFUSED = [
    # Anthropic: a PDF, a URL, a Files API file; in a user message and in a tool result
    ("anthropic_messages", anthropic(ASK, document(PDF)), "messages[0].content[1].source", "PDF"),
    (
        "anthropic_messages",
        anthropic(document({"type": "url", "url": "https://example.com/a.pdf"})),
        "messages[0].content[0].source",
        "fetches URLs",
    ),
    (
        "anthropic_messages",
        anthropic(document({"type": "file", "file_id": "file_011"})),
        "messages[0].content[0].source",
        "files API",
    ),
    (
        "anthropic_messages",
        anthropic(tool_result(ASK, document(PDF))),
        "messages[0].content[0].content[1].source",
        "PDF",
    ),
    (
        "anthropic_messages",
        anthropic(document({"type": "pdf"})),
        "messages[0].content[0].source.type",
        "'text' or 'content'",
    ),
    (
        "anthropic_messages",
        anthropic(document({"type": ["file"]})),  # no string: a 400 too, never a crash
        "messages[0].content[0].source.type",
        "'text' or 'content'",
    ),
    # Responses: input_file however given, in a message and in a tool output
    (
        "openai_responses",
        responses({"role": "user", "content": [INPUT_TEXT, FILE_DATA]}),
        "input[0].content[1].file_data",
        "files API",
    ),
    (
        "openai_responses",
        responses({"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}),
        "input[0].content[0].file_id",
        "files API",
    ),
    (
        "openai_responses",
        responses(
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_file", "file_url": "https://example.com/a.pdf"}],
            }
        ),
        "input[0].output[0].file_url",
        "files API",
    ),
    (
        "openai_responses",
        responses({"role": "user", "content": [{"type": "input_file"}]}),
        "input[0].content[0].type",
        "input_file is not supported",
    ),
    # chat: a file, a sound; in a user message and in a tool message
    (
        "openai_chat",
        chat({"role": "user", "content": [ASK, CHAT_FILE]}),
        "messages[0].content[1].file",
        "files API",
    ),
    (
        "openai_chat",
        chat({"role": "user", "content": [AUDIO]}),
        "messages[0].content[0].input_audio",
        "transcript",
    ),
    (
        "openai_chat",
        chat(
            {"role": "user", "content": "hi"},
            {"role": "tool", "tool_call_id": "c1", "content": [CHAT_FILE]},
        ),
        "messages[1].content[0].file",
        "files API",
    ),
    # Gemini: anything not an image, inline or by URI, in either case of field names
    (
        "gemini",
        gemini({"role": "user", "parts": [{"text": "summarize it"}, PDF_INLINE]}),
        "contents[0].parts[1].inlineData.mimeType",
        "'application/pdf'",
    ),
    (
        "gemini",
        gemini({"parts": [{"inline_data": {"mime_type": "audio/wav", "data": "UklGRg=="}}]}),
        "contents[0].parts[0].inlineData.mimeType",
        "'audio/wav'",
    ),
    (
        "gemini",
        gemini(
            {"role": "user", "parts": [{"fileData": {"mimeType": "video/mp4", "fileUri": "u"}}]}
        ),
        "contents[0].parts[0].fileData.mimeType",
        "'video/mp4'",
    ),
    (
        "gemini",
        gemini(
            {"role": "user", "parts": [{"fileData": {"mimeType": "text/plain", "fileUri": "u"}}]}
        ),
        "contents[0].parts[0].fileData.mimeType",
        "'text/plain'",  # a text file by URI: there is no files API to read it from
    ),
    (
        "gemini",
        gemini({"parts": [{"inlineData": {"mimeType": "text/plain", "data": "not base64!"}}]}),
        "contents[0].parts[0].inlineData.data",
        "not base64 of UTF-8 text",
    ),
    (
        "gemini",
        gemini({"parts": [{"inlineData": {"mimeType": "text/csv", "data": "/w=="}}]}),
        "contents[0].parts[0].inlineData.data",
        "not base64 of UTF-8 text",  # 0xff: not UTF-8
    ),
    (
        "gemini",
        gemini(
            {"role": "user", "parts": [{"text": "hi"}]}, {"role": "model", "parts": [PDF_INLINE]}
        ),
        "contents[1].parts[0].inlineData.mimeType",
        "'application/pdf'",
    ),
]


@pytest.mark.parametrize(("protocol", "body", "field", "says"), REFUSED)
def test_input_the_prompt_cannot_hold_is_a_400_naming_the_field(
    protocol: str, body: dict[str, Any], field: str, says: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        parse(protocol, body)
    err = info.value
    assert err.status == 400 and says in err.message
    assert err.param == field and err.message.startswith(field)
    status, shaped = SPECS[protocol].error_body(err.kind, err.message, err.param)
    assert status == 400 and field in str(shaped)  # named in every protocol's own shape


def test_an_anthropic_text_document_is_read_as_text_after_its_title_and_context() -> None:
    text = {"type": "text", "media_type": "text/plain", "data": "The grass is green."}
    conv = parse(
        "anthropic_messages",
        anthropic(ASK, document(text, title="notes.txt", context="from the wiki")),
    )
    (message,) = conv.messages
    assert message.content == [
        TextPart("summarize it"),
        TextPart("notes.txt\nfrom the wiki"),
        TextPart("The grass is green."),
    ]
    assert "dropped_blocks" not in conv.metadata
    # no title or context: the text alone; inside a tool result too
    conv = parse("anthropic_messages", anthropic(tool_result(document(text))))
    (result,) = conv.messages
    assert result.role == "tool" and result.content == [TextPart("The grass is green.")]


def test_an_anthropic_content_document_is_read_block_by_block() -> None:
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    blocks = [{"type": "text", "text": "page 1"}, image, {"type": "text", "text": "page 2"}]
    conv = parse(
        "anthropic_messages",
        anthropic(document({"type": "content", "content": blocks}, title="report")),
    )
    assert conv.messages[0].content == [
        TextPart("report"),
        TextPart("page 1"),
        ImagePart("data:image/png;base64,AA=="),
        TextPart("page 2"),
    ]
    conv = parse("anthropic_messages", anthropic(document({"type": "content", "content": "one"})))
    assert conv.messages[0].content == [TextPart("one")]
    # an image in it the proxy cannot read is refused by its own name
    by_file = {"type": "image", "source": {"type": "file", "file_id": "f"}}
    with pytest.raises(ProtocolError) as info:
        parse(
            "anthropic_messages",
            anthropic(document({"type": "content", "content": [by_file]})),
        )
    assert info.value.message.startswith("messages[0].content[0].source.content[0].source")


def test_a_chat_refusal_part_is_kept_as_the_assistants_text() -> None:
    refusal = {"type": "refusal", "refusal": "I can't help with that."}
    conv = parse(
        "openai_chat",
        chat(
            {"role": "user", "content": "do it"},
            {"role": "assistant", "content": [refusal]},
            {"role": "user", "content": "please"},
        ),
    )
    assert conv.messages[1].role == "assistant"
    assert conv.messages[1].content == [TextPart("I can't help with that.")]
    # a part whose type is no string is skipped, as any unknown part is (never a crash)
    odd = chat({"role": "user", "content": [{"type": ["file"], "file": {}}, ASK]})
    assert parse("openai_chat", odd).messages[0].content == [TextPart("summarize it")]


def test_gemini_images_are_read_as_before_with_or_without_a_type() -> None:
    parts = [
        {"inlineData": {"mimeType": "image/png", "data": "AA=="}},
        {"inline_data": {"data": "AA=="}},  # no type: the bytes decide, as before
        {"fileData": {"mimeType": "IMAGE/JPEG", "fileUri": "data:image/jpeg;base64,AA=="}},
        {"fileData": {"fileUri": "https://example.com/a.png"}},  # refused later, as a URL
    ]
    conv = parse("gemini", gemini({"role": "user", "parts": parts}))
    assert conv.messages[0].content == [
        ImagePart("data:image/png;base64,AA=="),
        ImagePart("data:application/octet-stream;base64,AA=="),
        ImagePart("data:image/jpeg;base64,AA=="),
        ImagePart("https://example.com/a.png"),
    ]


def test_what_has_no_place_in_a_prompt_stays_dropped_and_counted() -> None:
    conv = parse(
        "anthropic_messages",
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
            ],
        },
    )
    assert conv.metadata["dropped_blocks"] == ["redacted_thinking"]
    conv = parse(
        "openai_responses",
        responses({"type": "item_reference", "id": "msg_1"}, {"role": "user", "content": "hi"}),
    )
    assert conv.metadata["dropped_items"] == ["item_reference"]
    conv = parse(
        "gemini",
        gemini({"role": "user", "parts": [{"text": "hi"}, {"executableCode": {"code": "1"}}]}),
    )
    assert conv.metadata["dropped_parts"] == ["executableCode"]


def test_gemini_text_inline_data_is_read_as_its_text() -> None:
    notes = base64.b64encode("The grass is green. ✓".encode()).decode()
    conv = parse(
        "gemini",
        gemini(
            {
                "role": "user",
                "parts": [
                    {"text": "summarize it"},
                    {"inline_data": {"mime_type": "text/markdown", "data": notes}},
                ],
            }
        ),
    )
    (message,) = conv.messages
    assert message.content == [TextPart("summarize it"), TextPart("The grass is green. ✓")]
    assert "dropped_blocks" not in conv.metadata
