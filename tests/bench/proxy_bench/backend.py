"""An instant engine: answers SGLang's surface, and vLLM's chat completions, with fixed
bodies and no model at all.

    python -m tests.bench.proxy_bench.backend --port P [--host H] [--token-ids 1,2,3]

Raw asyncio protocol (HTTP/1.1 keep-alive, pipelining-safe, Content-Length bodies) so
the engine costs next to nothing and every microsecond measured is the proxy's. Serves
``POST /v1/chat/completions`` (SGLang 0.5.13 shape: prompt ids, meta_info logprobs,
weight version; ``"stream": true`` gets OpenAI chunks and ``[DONE]``), ``POST /generate``
(token mode; the reply's ids are ``--token-ids``), and ``/health``, ``/model_info``,
``/server_info`` for the proxy's start-up probe. ``POST /vllm/v1/chat/completions``
answers as vLLM 0.11+ does (for peers that expect vLLM, e.g. rLLM's gateway): the same
ids, plus ``prompt_token_ids`` and each choice's ``token_ids`` when the request asks
``return_token_ids``, and ``logprobs.content`` when it asks ``logprobs``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools

import orjson

MODEL = "bench-model"
TEXT = "Hello! How can I help you today?"
CHAT_OUTPUT_IDS = [9707, 0, 2585, 646, 358, 1492, 498, 3351, 30, 151645]
PROMPT_IDS = list(range(151644, 151644 + 20))
VLLM_API = "/vllm/v1"  # the vLLM face's OpenAI prefix
VLLM_CHAT_PATH = VLLM_API + "/chat/completions"
_VLLM_CHAT = VLLM_CHAT_PATH.encode()
USAGE = {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": len(CHAT_OUTPUT_IDS)}
USAGE["total_tokens"] = USAGE["prompt_tokens"] + USAGE["completion_tokens"]


def _logprobs(ids: list[int]) -> list[list]:
    return [[-0.01 * (i + 1), t, None] for i, t in enumerate(ids)]


def chat_body() -> bytes:
    meta = {
        "id": "bench",
        "finish_reason": {"type": "stop", "matched": CHAT_OUTPUT_IDS[-1]},
        "prompt_tokens": len(PROMPT_IDS),
        "completion_tokens": len(CHAT_OUTPUT_IDS),
        "weight_version": "default",
        "output_token_logprobs": _logprobs(CHAT_OUTPUT_IDS),
    }
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": TEXT, "tool_calls": None},
        "logprobs": None,
        "finish_reason": "stop",
        "prompt_token_ids": PROMPT_IDS,
        "meta_info": meta,
    }
    return orjson.dumps(
        {
            "id": "bench",
            "object": "chat.completion",
            "created": 1767225600,
            "model": MODEL,
            "choices": [choice],
            "usage": USAGE,
            "metadata": {"weight_version": "default"},
        }
    )


def _chunk(delta: dict, finish: str | None, choice: dict | None = None, **root) -> bytes:
    doc = {
        "id": "bench",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **(choice or {})}],
        **root,
    }
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def chat_stream_body() -> bytes:
    return b"".join(
        [
            _chunk({"role": "assistant", "content": ""}, None),
            _chunk({"content": TEXT}, None),
            _chunk({}, "stop", usage=USAGE),
            b"data: [DONE]\n\n",
        ]
    )


def _vllm_logprobs(ids: list[int]) -> dict:
    """vLLM's OpenAI logprobs; tokens spelled as ``return_tokens_as_token_ids`` does
    (the instant engine has no tokenizer)."""
    tokens = [f"token_id:{t}" for t in ids]
    return {
        "content": [
            {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
            for tok, (lp, _, _) in zip(tokens, _logprobs(ids), strict=True)
        ]
    }


def _vllm_extras(token_ids: bool, logprobs: bool) -> tuple[dict, dict]:
    """(root fields, choice fields) that vLLM adds for ``return_token_ids`` / ``logprobs``."""
    root = {"prompt_token_ids": PROMPT_IDS} if token_ids else {}
    choice = {"token_ids": CHAT_OUTPUT_IDS} if token_ids else {}
    choice["logprobs"] = _vllm_logprobs(CHAT_OUTPUT_IDS) if logprobs else None
    return root, choice


def vllm_chat_body(token_ids: bool, logprobs: bool) -> bytes:
    root, extra = _vllm_extras(token_ids, logprobs)
    message = {"role": "assistant", "content": TEXT, "tool_calls": []}
    choice = {"index": 0, "message": message, "finish_reason": "stop", "stop_reason": None}
    doc = {"id": "chatcmpl-bench", "object": "chat.completion", "created": 1767225600}
    doc.update(model=MODEL, choices=[{**choice, **extra}], usage=USAGE, prompt_logprobs=None)
    return orjson.dumps({**doc, **root})


def vllm_chat_stream_body(token_ids: bool, logprobs: bool) -> bytes:
    """Prompt ids ride on the first chunk, output ids and logprobs on the content's."""
    root, extra = _vllm_extras(token_ids, logprobs)
    return b"".join(
        [
            _chunk({"role": "assistant", "content": ""}, None, **root),
            _chunk({"content": TEXT}, None, extra),
            _chunk({}, "stop", usage=USAGE),
            b"data: [DONE]\n\n",
        ]
    )


def generate_body(n_prompt: int, ids: list[int]) -> bytes:
    return orjson.dumps(
        {
            "text": TEXT,
            "output_ids": ids,
            "meta_info": {
                "id": "bench",
                "finish_reason": {"type": "stop", "matched": ids[-1]},
                "prompt_tokens": n_prompt,
                "completion_tokens": len(ids),
                "weight_version": "default",
                "output_token_logprobs": _logprobs(ids),
            },
        }
    )


INFO = {
    "model_path": MODEL,
    "tokenizer_path": MODEL,
    "served_model_name": MODEL,
    "weight_version": "default",
    "is_generation": True,
    "version": "0.5.13",
    "context_length": 32768,
}


def response(status: int, body: bytes, ctype: bytes = b"application/json") -> bytes:
    reason = b"OK" if status == 200 else b"Not Found"
    head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (
        status,
        reason,
        ctype,
        len(body),
    )
    return head + body


class Answers:
    """Every reply, encoded once."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.chat = response(200, chat_body())
        self.chat_stream = response(200, chat_stream_body(), b"text/event-stream")
        self.vllm = {  # (stream, return_token_ids, logprobs) -> reply
            (False, ids, lp): response(200, vllm_chat_body(ids, lp))
            for ids, lp in itertools.product((False, True), repeat=2)
        }
        self.vllm.update(
            {
                (True, ids, lp): response(200, vllm_chat_stream_body(ids, lp), b"text/event-stream")
                for ids, lp in itertools.product((False, True), repeat=2)
            }
        )
        self.fixed = {
            (b"GET", b"/health"): response(200, b""),
            (b"GET", b"/model_info"): response(200, orjson.dumps(INFO)),
            (b"GET", b"/server_info"): response(200, orjson.dumps(INFO)),
            (b"GET", b"/v1/models"): response(
                200, orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            ),
        }
        self.not_found = response(404, b'{"detail":"Not Found"}')

    def answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        if path == b"/v1/chat/completions":
            return self.chat_stream if b'"stream":true' in body.replace(b" ", b"") else self.chat
        if path == _VLLM_CHAT:
            flat = body.replace(b" ", b"")
            asked = (b'"stream":true', b'"return_token_ids":true', b'"logprobs":true')
            return self.vllm[tuple(flag in flat for flag in asked)]
        if path == b"/generate":
            n_prompt = len(orjson.loads(body)["input_ids"])
            return response(200, generate_body(n_prompt, self.token_ids))
        return self.fixed.get((method, path.split(b"?", 1)[0]), self.not_found)


class HttpServer(asyncio.Protocol):
    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        out = []
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = self.buf[:end]
            length = _content_length(head)
            if len(self.buf) < end + 4 + length:
                break
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            method, path, _ = head.split(b"\r\n", 1)[0].split(b" ", 2)
            out.append(self.answers.answer(method, path, body))
        if out:
            self.transport.write(b"".join(out))


def _content_length(head: bytes) -> int:
    lower = head.lower()
    at = lower.find(b"\r\ncontent-length:")
    if at < 0:
        return 0
    end = lower.find(b"\r\n", at + 2)
    return int(lower[at + 17 : end if end > 0 else None].strip())


async def serve(port: int, answers: Answers, host: str = "127.0.0.1") -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: HttpServer(answers), host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")  # another address: a test's netns host
    ap.add_argument("--token-ids", default=",".join(map(str, CHAT_OUTPUT_IDS)))
    args = ap.parse_args()
    answers = Answers([int(t) for t in args.token_ids.split(",")])
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(serve(args.port, answers, args.host))


if __name__ == "__main__":
    main()
