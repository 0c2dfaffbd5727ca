"""The HTTP surface, in process: routing, tokens, limits, errors, keep-alives."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from litestar.testing import TestClient

from proxy.app import create_app
from proxy.conversation import ImagePart
from proxy.errors import ErrorKind, UpstreamError
from proxy.io.serving import after_reply
from proxy.sse import parse
from tests.unit.protocols.app_support import (
    CHAT,
    GEMINI,
    GENERATE,
    MESSAGES,
    SESSION,
    TOKEN,
    Scripted,
    protocol_shaped,
    resolve,
    streaming,
)

PROTOCOLS = list(GENERATE)


SHARED = Scripted()


@pytest.fixture(scope="module")
def client():
    with TestClient(
        create_app(SHARED.prepare, resolve, max_body_bytes=4096, keepalive_seconds=0.05)
    ) as c:
        yield c


@pytest.fixture
def handler() -> Scripted:
    SHARED.reset()  # a fresh script per test, one app per module
    return SHARED


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.mark.parametrize(
    ("path_prefix", "headers", "query"),
    [
        (f"/s/{TOKEN}", {}, ""),
        ("", {"authorization": f"Bearer {TOKEN}"}, ""),
        ("", {"x-api-key": TOKEN}, ""),
        ("", {"x-goog-api-key": TOKEN}, ""),
        ("", {}, f"?key={TOKEN}"),
        (f"/s/{TOKEN}", {"authorization": "Bearer some-dummy-key"}, ""),  # the path wins
    ],
)
def test_every_token_source_reaches_the_session(
    client, handler, path_prefix, headers, query
) -> None:
    path, body = CHAT
    r = client.post(path_prefix + path + query, json=body, headers=headers)
    assert r.status_code == 200, r.text
    session, conv, protocol, raw, seen_headers = handler.calls[-1]
    assert session == SESSION and protocol == "openai_chat"
    assert orjson.loads(raw) == body  # the raw body reaches the handler verbatim
    assert seen_headers.get("content-type") == "application/json"


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("token", [None, "not-a-session", TOKEN + "x"])
def test_unknown_or_missing_session_is_401_in_the_callers_protocol(
    client, handler, protocol, token
) -> None:
    path, body = GENERATE[protocol]
    r = client.post(path, json=body, headers=auth(token) if token else {})
    assert r.status_code == 401
    assert protocol_shaped(protocol, r.json())
    assert handler.calls == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_harness_model_name_is_echoed_and_session_model_fills_a_missing_one(
    client, protocol
) -> None:
    path, body = GENERATE[protocol]
    r = client.post(path, json=body, headers=auth())
    echoed = orjson.dumps(r.json()).decode()
    assert "harness-model" in echoed and "served-model" not in echoed
    if protocol != "gemini":  # Gemini always names its model in the path
        r = client.post(path, json={k: v for k, v in body.items() if k != "model"}, headers=auth())
        assert r.status_code == 200 and "served-model" in r.text


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_body_over_the_limit_is_413_in_the_callers_protocol(client, handler, protocol) -> None:
    path, body = GENERATE[protocol]
    big = {**body, "padding": "x" * 5000}
    r = client.post(
        path, content=orjson.dumps(big), headers={**auth(), "content-type": "application/json"}
    )
    assert r.status_code == 413 and protocol_shaped(protocol, r.json())

    def chunks():  # no content-length: the limit is enforced on the bytes read
        data = orjson.dumps(big)
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    r = client.post(path, content=chunks(), headers={**auth(), "content-type": "application/json"})
    assert r.status_code == 413 and protocol_shaped(protocol, r.json())
    assert r.headers["connection"] == "close"  # the rest of the body was never read
    # an unknown token with it: the 401 wins, and still closes the connection
    r = client.post(path, content=chunks(), headers={**auth("not-a-session")})
    assert r.status_code == 401 and r.headers["connection"] == "close"
    r = client.post(path, content=orjson.dumps(body), headers={**auth("not-a-session")})
    assert r.status_code == 401 and "connection" not in r.headers  # read whole: stays open
    assert handler.calls == []


def test_a_responses_image_by_file_id_is_a_400_naming_the_field(client, handler) -> None:
    """Polar has no files API: an image it cannot resolve is refused, never dropped."""
    path, body = GENERATE["openai_responses"]
    text = {"type": "input_text", "text": "how many stars?"}
    by_id = {"type": "input_image", "file_id": "file-abc123", "detail": "auto"}
    for item in (
        {"role": "user", "content": [text, by_id]},  # a user message
        {"type": "function_call_output", "call_id": "c1", "output": [by_id]},  # a tool result
    ):
        r = client.post(path, json={**body, "input": [item]}, headers=auth())
        assert r.status_code == 400 and protocol_shaped("openai_responses", r.json())
        error = r.json()["error"]
        assert "input_image.file_id is not supported" in error["message"]
        assert "data: URL" in error["message"]
        assert error["param"].startswith("input[0].") and error["param"].endswith(".file_id")
    # neither a URL nor a file id: the URL is what is missing
    r = client.post(
        path,
        json={**body, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        headers=auth(),
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0].image_url"
    assert handler.calls == []
    # an image_url with a file_id beside it is read by its URL
    url = {"type": "input_image", "image_url": "data:image/png;base64,iVBO", "file_id": "f"}
    r = client.post(
        path, json={**body, "input": [{"role": "user", "content": [url]}]}, headers=auth()
    )
    assert r.status_code == 200 and len(handler.calls) == 1
    (message,) = handler.calls[0][1].messages
    assert message.content == [ImagePart(url["image_url"])]


def test_an_anthropic_image_by_file_source_is_a_400_naming_the_field(client, handler) -> None:
    """The same for Anthropic's Files API source: refused in Anthropic's error shape."""
    path, body = MESSAGES
    by_file = {"type": "image", "source": {"type": "file", "file_id": "file_011abc"}}
    for content in (
        [{"type": "text", "text": "how many stars?"}, by_file],
        [{"type": "tool_result", "tool_use_id": "t1", "content": [by_file]}],
    ):
        r = client.post(
            path, json={**body, "messages": [{"role": "user", "content": content}]}, headers=auth()
        )
        assert r.status_code == 400 and protocol_shaped("anthropic_messages", r.json())
        message = r.json()["error"]["message"]
        assert message.startswith("messages[0].content[") and "'file' is not supported" in message
    for source in ({"type": "base64"}, {"type": "pdf"}, None):  # no data, no such type, none
        image = {"type": "image", "source": source}
        r = client.post(
            path, json={**body, "messages": [{"role": "user", "content": [image]}]}, headers=auth()
        )
        assert r.status_code == 400 and "messages[0].content[0].source" in r.text
    assert handler.calls == []
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    r = client.post(
        path, json={**body, "messages": [{"role": "user", "content": [image]}]}, headers=auth()
    )
    assert r.status_code == 200
    assert handler.calls[0][1].messages[0].content == [ImagePart("data:image/png;base64,AA==")]


PDF_B64 = "JVBERi0xLjQK"
UNREADABLE = {  # protocol: (what the request holds, the field its 400 names)
    "openai_chat": (
        {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]},
        "messages[0].content[0].file",
    ),
    "openai_responses": (
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
        "input[0].content[0].file_id",
    ),
    "anthropic_messages": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "summarize it"},
                        {
                            "type": "document",
                            "source": {
                                "type": "base64",
                                "media_type": "application/pdf",
                                "data": PDF_B64,
                            },
                        },
                    ],
                }
            ]
        },
        "messages[0].content[1].source",
    ),
    "gemini": (
        {
            "contents": [
                {"parts": [{"inlineData": {"mimeType": "application/pdf", "data": PDF_B64}}]}
            ]
        },
        "contents[0].parts[0].inlineData.mimeType",
    ),
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_document_or_sound_the_prompt_cannot_hold_is_a_400_naming_the_field(
    client, handler, protocol
) -> None:
    """The model must not answer about a file it never saw: refused in the caller's shape."""
    path, body = GENERATE[protocol]
    holding, field = UNREADABLE[protocol]
    r = client.post(path, json={**body, **holding}, headers=auth())
    assert r.status_code == 400 and protocol_shaped(protocol, r.json())
    error = r.json()["error"]
    assert error["message"].startswith(field)
    if "param" in error:
        assert error["param"] == field
    assert handler.calls == []


EXPECTED_STATUS = {
    ("anthropic_messages", ErrorKind.OVERLOADED): 529,
    ("anthropic_messages", ErrorKind.UNAVAILABLE): 529,
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    "kind", ["bad_request", "context_length", "unavailable", "overloaded", "capture_failed"]
)
@pytest.mark.parametrize("stream", [False, True])
def test_upstream_errors_come_back_with_the_protocols_status(
    client, handler, protocol, kind, stream
) -> None:
    handler.error = UpstreamError(500, "engine says no", kind)
    path, body = streaming(protocol) if stream else GENERATE[protocol]
    r = client.post(path, json=body, headers=auth())
    expected = EXPECTED_STATUS.get(
        (protocol, ErrorKind(kind)), 400 if kind in ("bad_request", "context_length") else 503
    )
    assert r.status_code == expected  # a quick failure gets its real status even on a stream
    assert protocol_shaped(protocol, r.json())
    assert "engine says no" in r.json()["error"]["message"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_handler_crash_is_a_protocol_shaped_500(client, handler, protocol) -> None:
    handler.error = RuntimeError("bug")
    path, body = GENERATE[protocol]
    r = client.post(path, json=body, headers=auth())
    assert r.status_code == 500 and protocol_shaped(protocol, r.json())
    assert "bug" not in r.text  # internals stay in the log


KEEPALIVE_SEEN = {
    "openai_chat": lambda raw, events: raw.startswith(b": keep-alive\n\n"),
    "openai_responses": lambda raw, events: raw.startswith(b": keep-alive\n\n"),
    "anthropic_messages": lambda raw, events: events[0].event == "ping",
    "gemini": lambda raw, events: (
        events[0].data["candidates"][0]["content"]["parts"] == [{"text": ""}]
    ),
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_slow_answers_are_preceded_by_protocol_legal_keepalives(client, handler, protocol) -> None:
    handler.delay = 0.3
    path, body = streaming(protocol)
    r = client.post(path, json=body, headers=auth())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse([r.content])
    assert KEEPALIVE_SEEN[protocol](r.content, events)
    assert "Running it." in r.text and "echo proof" in r.text


IN_STREAM_ERROR = {
    "openai_chat": lambda events: events[-1].data["error"]["code"] == "server_is_overloaded",
    "openai_responses": lambda events: (
        events[-1].event == "response.failed"
        and events[-1].data["response"]["error"]["code"] == "server_is_overloaded"
    ),
    "anthropic_messages": lambda events: (
        events[-1].event == "error" and events[-1].data["error"]["type"] == "overloaded_error"
    ),
    "gemini": lambda events: events[-1].data["error"]["status"] == "UNAVAILABLE",
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_failure_after_the_stream_started_is_the_protocols_in_stream_error(
    client, handler, protocol
) -> None:
    handler.delay = 0.2
    handler.error = UpstreamError(503, "engine overloaded", "overloaded")
    path, body = streaming(protocol)
    r = client.post(path, json=body, headers=auth())
    assert r.status_code == 200
    assert IN_STREAM_ERROR[protocol](parse([r.content]))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_bug_after_the_stream_started_is_still_an_in_stream_error(
    client, handler, protocol
) -> None:
    handler.delay = 0.2
    handler.error = RuntimeError("a bug in the handler")
    path, body = streaming(protocol)
    r = client.post(path, json=body, headers=auth())
    assert r.status_code == 200
    last = parse([r.content])[-1]
    assert last.event in ("error", "response.failed") or "error" in last.data
    assert "a bug" not in r.text  # the internals stay in the log


@pytest.mark.parametrize("prefix", ["", f"/s/{TOKEN}"])
def test_probes_models_and_count_tokens(client, prefix) -> None:
    for path in ("/", "/api/hello"):
        assert client.head(prefix + path).status_code == 200
    models = client.get(prefix + "/v1/models", headers=auth()).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "served-model"
    assert client.get(prefix + "/v1/models/anything", headers=auth()).json()["id"] == "served-model"
    assert (
        client.get(prefix + "/v1beta/models", headers=auth()).json()["models"][0]["name"]
        == "models/served-model"
    )
    assert client.get("/v1/models").status_code == 401  # no token anywhere
    n = client.post(prefix + "/v1/messages/count_tokens", json=MESSAGES[1], headers=auth()).json()
    assert n["input_tokens"] >= 1
    g = client.post(prefix + "/v1beta/models/m:countTokens", json=GEMINI[1], headers=auth()).json()
    assert g["totalTokens"] >= 1


def test_count_tokens_uses_the_wired_counter(handler) -> None:
    seen = []

    async def counter(session, conv, protocol, raw, headers) -> int:
        seen.append((protocol, orjson.loads(raw), headers.get("authorization")))
        return 1000 + len(conv.messages)

    with TestClient(create_app(handler.prepare, resolve, count_tokens=counter)) as c:
        r = c.post("/v1/messages/count_tokens", json=MESSAGES[1], headers=auth())
        assert r.json() == {"input_tokens": 1001}
    # what it needs to capture the call: the protocol, the body as sent, the headers
    assert seen == [("anthropic_messages", MESSAGES[1], auth()["authorization"])]


def test_gemini_stream_without_sse_is_one_json_array_and_unknown_methods_are_404(client) -> None:
    r = client.post("/v1beta/models/m:streamGenerateContent", json=GEMINI[1], headers=auth())
    chunks = r.json()
    assert isinstance(chunks, list) and chunks[-1]["candidates"][0]["finishReason"] == "STOP"
    r = client.post("/v1beta/models/m:embedContent", json=GEMINI[1], headers=auth())
    assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND"
    r = client.post(
        "/v1beta/models/org/model-with-slash:generateContent", json=GEMINI[1], headers=auth()
    )
    assert r.json()["modelVersion"] == "org/model-with-slash"


def test_unknown_paths_and_methods_get_an_error_every_sdk_can_read(client) -> None:
    r = client.get("/v2/nothing")
    assert r.status_code == 404
    body = r.json()
    assert body["type"] == "error" and body["error"]["message"] and body["error"]["code"] == 404
    assert client.get("/v1/chat/completions").status_code == 405


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_session_is_judged_before_the_body(client, handler, protocol) -> None:
    """The lookup runs while the body is parsed; its verdict still comes first."""
    path, _ = GENERATE[protocol]
    bad = b'{"model": "m", "messages": [tru'
    r = client.post(path, content=bad, headers={**auth("not-a-session"), "content-type": "x"})
    assert r.status_code == 401 and protocol_shaped(protocol, r.json())
    r = client.post(path, content=bad, headers={**auth(), "content-type": "x"})
    assert r.status_code == 400 and protocol_shaped(protocol, r.json())
    assert handler.calls == []


def test_a_refused_model_call_hands_its_session_back(handler) -> None:
    """A lookup for a model call may have numbered it: a refused request says so."""
    lookups, unused = [], []

    async def resolver(token: str, for_call: bool):
        lookups.append(for_call)
        return await resolve(token)

    async def on_unused(session, protocol: str, reason: str) -> None:
        unused.append((session, protocol, reason))

    with TestClient(create_app(handler.prepare, resolver, unused_call=on_unused)) as c:
        bad = {**auth(), "content-type": "application/json"}
        assert c.post(CHAT[0], content=b"{nope", headers=bad).status_code == 400
        assert unused == [(SESSION, "openai_chat", unused[0][2])]
        assert "not valid JSON" in unused[0][2]
        count = "/v1/messages/count_tokens"
        assert c.post(count, content=b"{nope", headers=bad).status_code == 400
        assert c.post(CHAT[0], json=CHAT[1], headers=auth()).status_code == 200
        assert len(unused) == 1  # count_tokens numbers nothing; a call that ran is no refusal
        assert lookups == [True, False, True]


@pytest.mark.parametrize("stream", [False, True])
async def test_after_reply_work_runs_once_the_answer_is_sent(stream) -> None:
    events: list[str] = []

    class Deferring(Scripted):
        async def __call__(self, *args):
            turn = await super().__call__(*args)
            after_reply(events.append, "after")
            after_reply(_fail)  # a failure there is logged, never the caller's
            events.append("answered")
            return turn

    def _fail() -> None:
        raise RuntimeError("after-reply work broke")

    app = create_app(Deferring().prepare, resolve)

    async def spied(scope, receive, send):  # notes when the answer's last bytes go out
        async def spy(message):
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                events.append("sent")

        await app(scope, receive, spy)

    transport = httpx.ASGITransport(app=spied)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
        r = await c.post(CHAT[0], json={**CHAT[1], "stream": stream}, headers=auth())
        assert r.status_code == 200 and (b"[DONE]" in r.content) == stream
    assert events == ["answered", "sent", "after"]


def test_resolver_failure_is_503_not_a_crash(handler) -> None:
    async def broken(token: str, for_call: bool):
        raise ConnectionError("redis down")

    with TestClient(create_app(handler.prepare, broken)) as c:
        r = c.post(MESSAGES[0], json=MESSAGES[1], headers={"x-api-key": TOKEN})
        assert (
            r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
        )  # retried by Claude Code


async def test_a_model_call_is_prepared_while_its_session_lookup_is_out(handler) -> None:
    """The handler's CPU work on the request runs before the lookup's reply is awaited;
    an unknown token is still a 401, and what the preparation decided is not made."""
    events: list[str] = []
    replies: list[asyncio.Future] = []

    def resolver(token: str, for_call: bool):  # sends the lookup; its reply comes later
        events.append("lookup sent")
        replies.append(asyncio.get_running_loop().create_future())
        replies[-1].set_result(SESSION if token == TOKEN else None)  # back before awaited
        return _awaited(replies[-1])

    async def _awaited(reply):
        events.append("lookup awaited")
        return await reply

    def prepare(conv, protocol, raw, headers):
        events.append("prepared")
        made = handler.prepare(conv, protocol, raw, headers)

        def make(session, render):
            events.append("made")
            return made(session, render)

        return make

    transport = httpx.ASGITransport(app=create_app(prepare, resolver))
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
        r = await c.post(CHAT[0], json=CHAT[1], headers=auth())
        assert r.status_code == 200
        assert events == ["lookup sent", "prepared", "lookup awaited", "made"]
        events.clear()
        r = await c.post(CHAT[0], json=CHAT[1], headers=auth("not-a-session"))
        assert r.status_code == 401 and protocol_shaped("openai_chat", r.json())
        assert events == ["lookup sent", "prepared", "lookup awaited"]  # never made
