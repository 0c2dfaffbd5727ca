"""Real clients against the proxy app as `polar serve proxy` serves it, and under granian.

The official ``openai`` (Chat Completions and Responses), ``anthropic`` and
``google-genai`` SDKs each run a full tool-call round trip, streaming and not, with the
session token in the base URL or as the API key. The model behind the proxy is a
scripted test double: it calls the first tool offered, then answers with the tool's
result. Also here: a client that disconnects cancels the handler (stream and not), and
raw HTTP (lengths, kept-alive and closed connections, 413s, litestar's own routes).
Each test runs against the app served by ``proxy.io.native`` (as `polar serve proxy`
serves it) and over ASGI under granian.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types as gt

from infra import localservers
from tests.integration.proxy_sdk_app import ARGS, MAX_BODY_BYTES, TOKEN

MODEL = "harness-model"  # what the harness asks for; the session's model is different
RESULT = "proof written"
REPO = Path(__file__).resolve().parents[2]
SHELL_SCHEMA = {
    "type": "object",
    "properties": {"command": {"type": "string"}},
    "required": ["command"],
}


# ---------------------------------------------------------------- server fixture


# native: as `polar serve proxy` runs the proxy (proxy.io.native); ASGI: the same app
# under granian, as any ASGI server runs it
@pytest.fixture(scope="module", params=["native", "ASGI"])
def server(request, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    markers = tmp_path_factory.mktemp("markers")
    port = localservers.free_port()
    app = "tests.integration.proxy_sdk_app:make_app"
    if request.param == "native":
        code = (
            f"from proxy.io.native import serve_native; serve_native({app!r}, '127.0.0.1', {port})"
        )
    else:
        code = (
            "from granian import Granian; from granian.constants import Interfaces, Loops; "
            f"Granian({app!r}, address='127.0.0.1', port={port}, interface=Interfaces.ASGI, "
            "workers=1, factory=True, loop=Loops.asyncio, log_access=False).serve()"
        )
    env = {**os.environ, "POLAR_TEST_MARKERS": str(markers), "PYTHONPATH": str(REPO)}
    log = markers / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_up(f"http://127.0.0.1:{port}", proc, log)
        yield f"http://127.0.0.1:{port}", markers
    finally:
        localservers.stop_process(proc.pid)
        proc.wait(10)


def _wait_up(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.head(f"{url}/api/hello", timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"server not up: {log.read_text()[-2000:]}")


AUTH_MODES = ["token_in_path", "token_as_key"]


def base_and_key(url: str, mode: str, suffix: str = "") -> tuple[str, str]:
    if mode == "token_in_path":
        return f"{url}/s/{TOKEN}{suffix}", "unused-dummy-key"
    return f"{url}{suffix}", TOKEN


# ---------------------------------------------------------------- OpenAI Chat Completions

CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command",
            "parameters": SHELL_SCHEMA,
        },
    }
]


@pytest.mark.parametrize("mode", AUTH_MODES)
def test_openai_chat_tool_round_trip(server, mode) -> None:
    base, key = base_and_key(server[0], mode, "/v1")
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    messages: list = [{"role": "user", "content": "write proof into proof.txt"}]

    first = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS)
    assert first.model == MODEL and first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "run_shell" and json.loads(call.function.arguments) == ARGS

    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": [{"type": "text", "text": RESULT}]},
    ]
    with client.chat.completions.stream(
        model=MODEL, messages=messages, tools=CHAT_TOOLS, stream_options={"include_usage": True}
    ) as stream:
        final = stream.get_final_completion()
    assert final.model == MODEL
    assert final.choices[0].message.content == f"The tool said: {RESULT}"
    assert final.usage is not None and final.usage.prompt_tokens == 3


def test_openai_chat_streamed_tool_call_and_raw_chunks(server) -> None:
    client = openai.OpenAI(base_url=f"{server[0]}/v1", api_key=TOKEN, max_retries=0)
    with client.chat.completions.stream(
        model=MODEL, messages=[{"role": "user", "content": "go"}], tools=CHAT_TOOLS
    ) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "run_shell" and json.loads(call.function.arguments) == ARGS
    assert final.choices[0].finish_reason == "tool_calls"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == "Hello from the proxy."
    )


# ---------------------------------------------------------------- OpenAI Responses

RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "run_shell",
        "description": "Run a shell command",
        "parameters": SHELL_SCHEMA,
        "strict": False,
    }
]


@pytest.mark.parametrize("mode", AUTH_MODES)
def test_openai_responses_tool_round_trip(server, mode) -> None:
    base, key = base_and_key(server[0], mode, "/v1")
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    user = {
        "role": "user",
        "content": [{"type": "input_text", "text": "write proof into proof.txt"}],
    }

    with client.responses.stream(
        model=MODEL, input=[user], tools=RESPONSES_TOOLS, store=False
    ) as stream:
        first = stream.get_final_response()
    assert first.model == MODEL and first.status == "completed"
    call = next(o for o in first.output if o.type == "function_call")
    assert call.name == "run_shell" and json.loads(call.arguments) == ARGS
    reasoning = next(o for o in first.output if o.type == "reasoning")

    followup = [
        user,
        reasoning.model_dump(exclude_none=True),
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT},
    ]
    second = client.responses.create(
        model=MODEL, input=followup, tools=RESPONSES_TOOLS, store=False
    )
    assert second.model == MODEL
    assert second.output_text == f"The tool said: {RESULT}"
    assert (
        second.usage is not None and second.usage.input_tokens == 3
    )  # reasoning + call = one assistant turn


def test_openai_responses_nonstream_call_and_stream_events(server) -> None:
    client = openai.OpenAI(base_url=f"{server[0]}/s/{TOKEN}/v1", api_key="x", max_retries=0)
    first = client.responses.create(model=MODEL, input="go", tools=RESPONSES_TOOLS)
    assert [o.type for o in first.output] == ["reasoning", "function_call"]
    events = [e.type for e in client.responses.create(model=MODEL, input="hi", stream=True)]
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert "response.output_text.delta" in events


# ---------------------------------------------------------------- Anthropic Messages

ANTHROPIC_TOOLS = [
    {"name": "run_shell", "description": "Run a shell command", "input_schema": SHELL_SCHEMA}
]


@pytest.mark.parametrize("mode", AUTH_MODES)
def test_anthropic_tool_round_trip(server, mode) -> None:
    base, key = base_and_key(server[0], mode)
    client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)
    messages: list = [{"role": "user", "content": "write proof into proof.txt"}]

    with client.messages.stream(
        model=MODEL, max_tokens=256, messages=messages, tools=ANTHROPIC_TOOLS
    ) as stream:
        first = stream.get_final_message()
    assert first.model == MODEL and first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "run_shell" and use.input == ARGS
    assert next(b for b in first.content if b.type == "thinking").thinking == "I should run it."

    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}],
        },
    ]
    second = client.messages.create(
        model=MODEL, max_tokens=256, messages=messages, tools=ANTHROPIC_TOOLS
    )
    assert second.model == MODEL and second.stop_reason == "end_turn"
    assert second.content[0].text == f"The tool said: {RESULT}"


def test_anthropic_beta_nonstream_tool_call_count_tokens_and_errors(server) -> None:
    client = anthropic.Anthropic(base_url=f"{server[0]}/s/{TOKEN}", api_key="x", max_retries=0)
    msg = client.beta.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": "go"}],
        tools=ANTHROPIC_TOOLS,
        betas=["context-management-2025-06-27"],
    )
    assert msg.content[-1].type == "tool_use" and msg.content[-1].input == ARGS
    n = client.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}]
    )
    assert n.input_tokens >= 1
    bad = anthropic.Anthropic(base_url=server[0], api_key="wrong-token", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------- Gemini

GEMINI_CONFIG = gt.GenerateContentConfig(
    tools=[
        gt.Tool(
            function_declarations=[
                gt.FunctionDeclaration(
                    name="run_shell",
                    description="Run a shell command",
                    parameters_json_schema=SHELL_SCHEMA,
                )
            ]
        )
    ],
    automatic_function_calling=gt.AutomaticFunctionCallingConfig(disable=True),
)


def gemini_client(url: str, mode: str) -> genai.Client:
    base, key = base_and_key(url, mode)
    return genai.Client(api_key=key, http_options=gt.HttpOptions(base_url=base))


@pytest.mark.parametrize("mode", AUTH_MODES)
def test_gemini_tool_round_trip(server, mode) -> None:
    client = gemini_client(server[0], mode)
    user = gt.Content(role="user", parts=[gt.Part(text="write proof into proof.txt")])

    first = client.models.generate_content(model=MODEL, contents=[user], config=GEMINI_CONFIG)
    assert first.model_version == MODEL
    call = first.function_calls[0]
    assert call.name == "run_shell" and call.args == ARGS

    reply = gt.Content(
        role="user",
        parts=[
            gt.Part(
                function_response=gt.FunctionResponse(
                    id=call.id, name=call.name, response={"output": RESULT}
                )
            )
        ],
    )
    chunks = list(
        client.models.generate_content_stream(
            model=MODEL, contents=[user, first.candidates[0].content, reply], config=GEMINI_CONFIG
        )
    )
    assert "".join(c.text or "" for c in chunks) == f"The tool said: {RESULT}"
    assert chunks[-1].candidates[0].finish_reason == gt.FinishReason.STOP
    assert chunks[-1].usage_metadata.prompt_token_count == 3


def test_gemini_streamed_function_call_and_count_tokens(server) -> None:
    client = gemini_client(server[0], "token_in_path")
    chunks = list(
        client.models.generate_content_stream(model=MODEL, contents="go", config=GEMINI_CONFIG)
    )
    calls = [fc for c in chunks for fc in (c.function_calls or [])]
    assert [(fc.name, fc.args) for fc in calls] == [("run_shell", ARGS)]
    assert client.models.count_tokens(model=MODEL, contents="hello there").total_tokens >= 1


# ---------------------------------------------------------------- keep-alives before the first event


def test_every_sdk_streams_through_keepalives_sent_before_the_answer(server) -> None:
    url = server[0]
    ask = "pause, then write proof"
    oai = openai.OpenAI(base_url=f"{url}/s/{TOKEN}/v1", api_key="x", max_retries=0)
    with oai.chat.completions.stream(
        model=MODEL, messages=[{"role": "user", "content": ask}], tools=CHAT_TOOLS
    ) as s:
        assert (
            s.get_final_completion().choices[0].message.tool_calls[0].function.name == "run_shell"
        )
    with oai.responses.stream(model=MODEL, input=ask, tools=RESPONSES_TOOLS) as s:
        assert [o.type for o in s.get_final_response().output] == ["reasoning", "function_call"]
    claude = anthropic.Anthropic(base_url=f"{url}/s/{TOKEN}", api_key="x", max_retries=0)
    with claude.messages.stream(
        model=MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": ask}],
        tools=ANTHROPIC_TOOLS,
    ) as s:
        assert s.get_final_message().content[-1].input == ARGS
    gem = gemini_client(url, "token_in_path")
    chunks = list(
        gem.models.generate_content_stream(model=MODEL, contents=ask, config=GEMINI_CONFIG)
    )
    assert [fc.args for c in chunks for fc in (c.function_calls or [])] == [ARGS]
    assert chunks[0].candidates[0].content.parts[0].text == ""  # the keep-alive chunk, harmless


# ---------------------------------------------------------------- disconnects cancel the engine call


def _wait_for_marker(markers: Path, protocol: str, before: set[Path]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if {p for p in markers.glob(f"cancelled-{protocol}-*")} - before:
            return
        time.sleep(0.05)
    raise AssertionError(f"handler for {protocol} was not cancelled")


def test_a_client_leaving_a_stream_cancels_the_handler(server) -> None:
    url, markers = server
    before = set(markers.glob("cancelled-anthropic_messages-*"))
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "slow please"}],
    }
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", f"{url}/s/{TOKEN}/v1/messages", json=body) as r,
    ):
        assert r.status_code == 200
        first = next(r.iter_raw())
        assert first.startswith(b"event: ping\n")  # keep-alives flow while the model works
    _wait_for_marker(markers, "anthropic_messages", before)


def test_a_client_leaving_a_plain_request_cancels_the_handler(server) -> None:
    url, markers = server
    before = set(markers.glob("cancelled-openai_chat-*"))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "slow please"}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {TOKEN}"},
            timeout=0.5,
        )
    _wait_for_marker(markers, "openai_chat", before)


# ---------------------------------------------------------------- raw HTTP


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length body (what these tests expect)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {buf!r}"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length]


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _post_head(path: str, extra: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n{extra}\r\n"
    ).encode()


def test_json_answers_carry_their_length_on_a_kept_alive_connection(server) -> None:
    url, _ = server
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = _post_head(f"/s/{TOKEN}/v1/chat/completions", f"content-length: {len(body)}\r\n")
    with _connect(url) as sock:
        for _ in range(3):  # one connection, one request after another
            sock.sendall(request + body)
            status, headers, answer = _read_response(sock)
            assert status == 200 and headers["content-type"] == "application/json"
            assert json.loads(answer)["choices"][0]["message"]["content"] == "Hello from the proxy."


def test_a_declared_body_over_the_limit_is_a_413_that_closes_the_connection(server) -> None:
    url, _ = server
    too_long = f"content-length: {MAX_BODY_BYTES + 1}\r\n"
    with _connect(url) as sock:  # the body is never sent: the answer must not wait for it
        sock.sendall(_post_head(f"/s/{TOKEN}/v1/messages", too_long))
        status, headers, answer = _read_response(sock)
        assert status == 413
        assert json.loads(answer)["type"] == "error"  # Anthropic's shape, on its route
        assert headers.get("connection") == "close"
        assert _closed_by_server(sock)


def test_a_chunked_body_over_the_limit_is_a_413(server) -> None:
    url, _ = server
    chunk = b"x" * 65536
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    with _connect(url) as sock:
        sock.sendall(
            _post_head(f"/s/{TOKEN}/v1/chat/completions", "transfer-encoding: chunked\r\n")
        )
        try:  # the server may answer and close before all of it is sent
            for _ in range(MAX_BODY_BYTES // len(chunk) + 2):
                sock.sendall(framed)
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, _, answer = _read_response(sock)
    assert status == 413
    assert "larger than" in json.loads(answer)["error"]["message"]


def test_litestar_serves_the_other_routes(server) -> None:
    url, _ = server
    with httpx.Client(base_url=url, timeout=10) as client:
        models = client.get(f"/s/{TOKEN}/v1/models")
        assert models.status_code == 200 and models.json()["object"] == "list"
        health = client.get("/healthz")
        assert health.status_code == 200 and health.json()["ok"] is True
        metrics = client.get("/metrics")
        assert metrics.status_code == 200 and "# TYPE" in metrics.text
        assert client.head(f"/s/{TOKEN}/").status_code == 200  # a harness's probe
        missing = client.post(f"/s/{TOKEN}/v1/nothing-here", json={})
        assert missing.status_code == 404 and "error" in missing.json()
        wrong = client.get(f"/s/{TOKEN}/v1/chat/completions")
        assert wrong.status_code == 405 and "error" in wrong.json()
        unknown = client.get("/v1/models", headers={"authorization": "Bearer nope"})
        assert unknown.status_code == 401
