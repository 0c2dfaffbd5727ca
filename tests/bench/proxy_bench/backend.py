"""An instant engine: answers SGLang's surface with fixed bodies and no model at all.

    python -m tests.bench.proxy_bench.backend --port P [--token-ids 1,2,3]

Raw asyncio protocol (HTTP/1.1 keep-alive, pipelining-safe, Content-Length bodies) so
the engine costs next to nothing and every microsecond measured is the proxy's. Serves
``POST /v1/chat/completions`` (SGLang 0.5.13 shape: prompt ids, meta_info logprobs,
weight version; ``"stream": true`` gets OpenAI chunks and ``[DONE]``), ``POST /generate``
(token mode; the reply's ids are ``--token-ids``), and ``/health``, ``/model_info``,
``/server_info`` for the proxy's start-up probe.
"""

from __future__ import annotations

import argparse
import asyncio

import orjson

MODEL = "bench-model"
TEXT = "Hello! How can I help you today?"
CHAT_OUTPUT_IDS = [9707, 0, 2585, 646, 358, 1492, 498, 3351, 30, 151645]
PROMPT_IDS = list(range(151644, 151644 + 20))


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
    usage = {"prompt_tokens": 20, "completion_tokens": 10, "total_tokens": 30}
    return orjson.dumps(
        {
            "id": "bench",
            "object": "chat.completion",
            "created": 1767225600,
            "model": MODEL,
            "choices": [choice],
            "usage": usage,
            "metadata": {"weight_version": "default"},
        }
    )


def chat_stream_body() -> bytes:
    def chunk(delta: dict, finish: str | None, **extra) -> bytes:
        doc = {
            "id": "bench",
            "object": "chat.completion.chunk",
            "created": 1767225600,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            **extra,
        }
        return b"data: " + orjson.dumps(doc) + b"\n\n"

    usage = {"prompt_tokens": 20, "completion_tokens": 10, "total_tokens": 30}
    return b"".join(
        [
            chunk({"role": "assistant", "content": ""}, None),
            chunk({"content": TEXT}, None),
            chunk({}, "stop", usage=usage),
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


async def serve(port: int, answers: Answers) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: HttpServer(answers), "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--token-ids", default=",".join(map(str, CHAT_OUTPUT_IDS)))
    args = ap.parse_args()
    answers = Answers([int(t) for t in args.token_ids.split(",")])
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(serve(args.port, answers))


if __name__ == "__main__":
    main()
