"""Properties of every protocol's stream, for arbitrary model answers.

- Any chunking of a stream's bytes parses back to the same events.
- A client that accumulates the stream the way the protocol's SDKs do gets exactly the
  non-streaming reply: same text, reasoning, tool calls, finish reason, usage.
"""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.conversation import AssistantTurn, Conversation, ToolCall, Usage
from proxy.protocols import anthropic_messages, gemini, openai_chat, openai_responses
from proxy.protocols.base import ReplyIds
from proxy.sse import SseEvent, encode, encode_all, parse
from tests.unit.protocols.golden import IDS, cases

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,  # deterministic runs; no example database on disk
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
STREAMS = [c.dir / "stream.sse" for c in cases()]

# text with the characters that break naive SSE framing: newlines, CR, U+2028, "data:" lookalikes
_pieces = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"]), max_size=12
) | st.sampled_from(["\n", "\r", "\r\n", "\u2028", "data: ", ":", "\n\n"])
texts = st.lists(_pieces, max_size=5).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(texts, json_values, max_size=4).map(lambda d: orjson.dumps(d).decode())
tool_calls = st.lists(
    st.builds(
        ToolCall,
        st.sampled_from(["", "call_x1", "toolu_9"]),
        st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
        arguments,
    ),
    max_size=3,
    unique_by=lambda c: c.id or object(),
)
turns = st.builds(
    AssistantTurn,
    text=texts,
    reasoning=texts,
    tool_calls=tool_calls,
    finish_reason=st.sampled_from(["stop", "length", "tool_calls", "abort"]),
    usage=st.builds(
        Usage, prompt_tokens=st.integers(0, 10**6), completion_tokens=st.integers(0, 10**5)
    ),
)
CONV = Conversation(model="harness-model", metadata={"include_usage": True})


@given(data=st.data())
@SETTINGS
def test_any_chunking_of_a_golden_stream_parses_the_same(data: st.DataObject) -> None:
    raw = data.draw(st.sampled_from(STREAMS)).read_bytes()
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=30)))
    chunks = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    assert parse(chunks) == parse([raw])
    assert len(parse([raw])) >= 1


@given(turn=turns, data=st.data())
@SETTINGS
def test_any_chunking_of_any_rendered_stream_parses_the_same(
    turn: AssistantTurn, data: st.DataObject
) -> None:
    spec = data.draw(st.sampled_from([openai_chat, openai_responses, anthropic_messages, gemini]))
    events = list(spec.render_stream(turn, CONV, IDS))
    raw = encode_all(events)
    size = data.draw(st.integers(1, 64))
    assert parse(raw[i : i + size] for i in range(0, len(raw), size)) == events


def test_crlf_and_cr_line_ends_and_comments_parse_like_lf() -> None:
    ev = SseEvent({"a": "x\ny"}, "message_start")
    lf = b": keep-alive\n\n" + encode(ev)
    assert (
        parse([lf.replace(b"\n", b"\r\n")])
        == parse([lf.replace(b"\n", b"\r")])
        == parse([lf])
        == [ev]
    )
    assert parse([b'data: {"a":\ndata: 1}\n\n']) == [
        SseEvent({"a": 1})
    ]  # data lines join with newlines


# ---- stream == non-stream, accumulated the way each protocol's clients do ----


@given(turn=turns)
@SETTINGS
def test_openai_chat_stream_accumulates_to_the_response(turn: AssistantTurn) -> None:
    events = parse([encode_all(openai_chat.render_stream(turn, CONV, IDS))])
    assert events[-1].data == "[DONE]"
    chunks = [e.data for e in events[:-1]]
    message: dict[str, Any] = {"content": "", "reasoning_content": ""}
    calls: dict[int, dict[str, Any]] = {}
    for c in chunks[:-1]:
        delta = c["choices"][0]["delta"]
        message["content"] += delta.get("content") or ""
        message["reasoning_content"] += delta.get("reasoning_content") or ""
        for tc in delta.get("tool_calls", []):
            slot = calls.setdefault(tc["index"], {"id": tc.get("id"), "name": "", "arguments": ""})
            slot["name"] += tc.get("function", {}).get("name", "")
            slot["arguments"] += tc["function"]["arguments"]
    full = openai_chat.render_response(turn, CONV, IDS)
    choice = full["choices"][0]
    assert message["content"] == (choice["message"]["content"] or "")
    assert message["reasoning_content"] == choice["message"].get("reasoning_content", "")
    expected = [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in choice["message"].get("tool_calls", [])
    ]
    assert [calls[i] for i in sorted(calls)] == expected
    assert chunks[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["usage"] == full["usage"] and chunks[-1]["choices"] == []


@given(turn=turns)
@SETTINGS
def test_openai_responses_stream_accumulates_to_the_response(turn: AssistantTurn) -> None:
    events = parse([encode_all(openai_responses.render_stream(turn, CONV, IDS))])
    assert [e.data["sequence_number"] for e in events] == list(range(len(events)))
    assert all(e.event == e.data["type"] for e in events)
    assert events[0].event == "response.created" and events[1].event == "response.in_progress"
    full = openai_responses.render_response(turn, CONV, IDS)
    assert events[-1].event == f"response.{full['status']}"
    assert events[-1].data["response"] == full
    done_items = [e.data["item"] for e in events if e.event == "response.output_item.done"]
    assert done_items == full["output"]
    streamed = "".join(e.data["delta"] for e in events if e.event.endswith(".delta"))
    assert streamed == "".join(_item_text(i) for i in full["output"])


@given(turn=turns)
@SETTINGS
def test_openai_responses_stream_satisfies_the_strict_js_accumulator(turn: AssistantTurn) -> None:
    """The openai JS SDK's rules: a delta needs its output item and, for text, the content
    part announced by ``response.content_part.added`` (reasoning included)."""
    output: list[dict[str, Any]] = []
    for e in parse([encode_all(openai_responses.render_stream(turn, CONV, IDS))]):
        d = e.data
        if e.event == "response.output_item.added":
            assert d["output_index"] == len(output)
            output.append(orjson.loads(orjson.dumps(d["item"])))
        elif e.event == "response.content_part.added":
            output[d["output_index"]].setdefault("content", []).append(dict(d["part"]))
        elif e.event in ("response.output_text.delta", "response.reasoning_text.delta"):
            part = output[d["output_index"]]["content"][d["content_index"]]
            assert part["type"] == ("output_text" if "output_text" in e.event else "reasoning_text")
            part["text"] += d["delta"]
        elif e.event == "response.function_call_arguments.delta":
            output[d["output_index"]]["arguments"] += d["delta"]
        elif e.event == "response.custom_tool_call_input.delta":
            output[d["output_index"]]["input"] += d["delta"]
        elif e.event == "response.output_item.done":
            item = output[d["output_index"]]
            assert item.get("content", []) == d["item"].get("content", [])
            assert item.get("arguments") == d["item"].get("arguments")
            assert item.get("input") == d["item"].get("input")


def _item_text(item: dict[str, Any]) -> str:
    if item["type"] in ("reasoning", "message"):
        return item["content"][0]["text"]
    return item.get("arguments", item.get("input", ""))


@given(turn=turns)
@SETTINGS
def test_anthropic_stream_accumulates_to_the_message(turn: AssistantTurn) -> None:
    events = parse([encode_all(anthropic_messages.render_stream(turn, CONV, IDS))])
    assert all(e.event == e.data["type"] for e in events)
    message = events[0].data["message"]
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for e in events[1:]:
        d = e.data
        if e.event == "content_block_start":
            assert d["index"] == len(blocks)
            blocks.append(dict(d["content_block"]))
        elif e.event == "content_block_delta":
            delta, block = d["delta"], blocks[d["index"]]
            if delta["type"] == "input_json_delta":
                partial[d["index"]] = partial.get(d["index"], "") + delta["partial_json"]
            else:
                key = "text" if delta["type"] == "text_delta" else "thinking"
                block[key] += delta[key]
        elif e.event == "content_block_stop" and d["index"] in partial:
            blocks[d["index"]]["input"] = orjson.loads(partial[d["index"]])
        elif e.event == "message_delta":
            message.update(d["delta"])
            message["usage"].update(d["usage"])
    assert events[-1].event == "message_stop"
    message["content"] = blocks
    assert message == anthropic_messages.render_response(turn, CONV, IDS)


@given(turn=turns)
@SETTINGS
def test_gemini_stream_accumulates_to_the_response(turn: AssistantTurn) -> None:
    chunks = [e.data for e in parse([encode_all(gemini.render_stream(turn, CONV, IDS))])]
    assert all(e is None for e in (c["candidates"][0].get("finishReason") for c in chunks[:-1]))
    full = gemini.render_response(turn, CONV, IDS)
    parts = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
    assert parts == full["candidates"][0]["content"]["parts"]
    assert chunks[-1]["candidates"][0]["finishReason"] == full["candidates"][0]["finishReason"]
    assert chunks[-1]["usageMetadata"] == full["usageMetadata"]


@given(turn=turns)
@SETTINGS
def test_tool_call_ids_are_stable_and_unique_across_protocols(turn: AssistantTurn) -> None:
    ids = ReplyIds("feedbeef", 1)
    chat = [
        c["id"]
        for c in openai_chat.render_response(turn, CONV, ids)["choices"][0]["message"].get(
            "tool_calls", []
        )
    ]
    claude = [
        b["id"]
        for b in anthropic_messages.render_response(turn, CONV, ids)["content"]
        if b["type"] == "tool_use"
    ]
    assert len(set(chat)) == len(chat) == len(turn.tool_calls) == len(claude)
    assert all(
        given_id in got for given_id, got in zip([c.id for c in turn.tool_calls], chat, strict=True)
    )
