"""The proxy bench's instant engine: SGLang's chat shape on ``/v1``, vLLM's on its vLLM
face, with token ids and logprobs only when asked (as vLLM does)."""

from __future__ import annotations

import json

import pytest

from tests.bench.proxy_bench.backend import (
    CHAT_OUTPUT_IDS,
    PROMPT_IDS,
    TEXT,
    VLLM_CHAT_PATH,
    Answers,
)

MESSAGES = [{"role": "user", "content": "Say hello."}]


def _ask(path: str, body: dict) -> tuple[bytes, bytes]:
    """(head, body) of the engine's reply to ``body`` sent as a client would (spaces in
    the JSON, as Python's json.dumps writes it)."""
    reply = Answers(CHAT_OUTPUT_IDS).answer(b"POST", path.encode(), json.dumps(body).encode())
    head, payload = reply.split(b"\r\n\r\n", 1)
    assert int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]) == len(payload)
    return head, payload


def _events(payload: bytes) -> list[dict]:
    frames = [f.removeprefix(b"data: ") for f in payload.split(b"\n\n") if f]
    assert frames[-1] == b"[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def test_sglang_chat_keeps_its_shape_when_asked_for_token_ids() -> None:
    flags = {"return_prompt_token_ids": True, "return_token_ids": True, "return_meta_info": True}
    _, payload = _ask("/v1/chat/completions", {"messages": MESSAGES, **flags})
    choice = json.loads(payload)["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT_IDS
    assert [e[1] for e in choice["meta_info"]["output_token_logprobs"]] == CHAT_OUTPUT_IDS


def test_vllm_face_returns_ids_and_logprobs_when_asked() -> None:
    body = {"messages": MESSAGES, "logprobs": True, "return_token_ids": True}
    head, payload = _ask(VLLM_CHAT_PATH, body)
    assert b"application/json" in head
    doc = json.loads(payload)
    choice = doc["choices"][0]
    assert doc["prompt_token_ids"] == PROMPT_IDS
    assert choice["token_ids"] == CHAT_OUTPUT_IDS
    assert choice["message"]["content"] == TEXT
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in CHAT_OUTPUT_IDS]
    assert all(e["logprob"] < 0 for e in content)


def test_vllm_face_leaves_out_what_was_not_asked() -> None:
    doc = json.loads(_ask(VLLM_CHAT_PATH, {"messages": MESSAGES})[1])
    assert "prompt_token_ids" not in doc
    assert "token_ids" not in doc["choices"][0]
    assert doc["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("token_ids", [True, False])
def test_vllm_face_streams_prompt_ids_first_and_output_ids_with_the_text(token_ids: bool) -> None:
    body = {"messages": MESSAGES, "stream": True, "logprobs": True}
    if token_ids:
        body["extra_body"] = {"return_token_ids": True}  # the OpenAI SDK's way, nested
    head, payload = _ask(VLLM_CHAT_PATH, body)
    assert b"text/event-stream" in head
    events = _events(payload)
    choices = [e["choices"][0] for e in events]
    assert ("prompt_token_ids" in events[0]) is token_ids
    assert events[0].get("prompt_token_ids", PROMPT_IDS) == PROMPT_IDS
    ids = [t for c in choices for t in c.get("token_ids", [])]
    assert ids == (CHAT_OUTPUT_IDS if token_ids else [])
    logprobs = [e for c in choices if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert len(logprobs) == len(CHAT_OUTPUT_IDS)
    assert "".join(c["delta"].get("content") or "" for c in choices) == TEXT
    assert choices[-1]["finish_reason"] == "stop"
