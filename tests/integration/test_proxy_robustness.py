"""The real proxy process under bad input and long calls.

Bad input: a RUNNING session with captured calls, then hypothesis-generated bad requests
at every endpoint with that session's token (malformed JSON, wrong JSON types, missing
fields, out-of-range values, huge bodies, unknown tokens): every answer is a 4xx, the
process stays up, the engine is never called and the session's records are byte-identical.

Long calls (the policy's SLOW REPLY, ~4,800 tokens): keep-alives flow while the engine
works, so a client whose idle timeout is shorter than the call still gets its answer; a
client that hangs up cancels the engine request, and the call is recorded as aborted.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import encode
from services.common.bus import Bus
from tests.helpers.stack import (
    new_session,
    proxy_process,
)
from tests.integration.proxy_agents import ChatAgent, captured, run_loop

LIMIT = 64 * 1024
KEEPALIVE = 0.1  # seconds between keep-alives while the engine works
ADMIN = "admin-secret"
FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,  # the same examples every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}}


@dataclass(frozen=True)
class Endpoint:
    name: str
    path: str
    body: dict[str, Any]  # a valid request
    required: tuple[str, ...]
    admin: bool = False


ENDPOINTS = (
    Endpoint(
        "chat",
        "/v1/chat/completions",
        {
            "model": "m",
            "stream": True,
            "max_tokens": 64,
            "temperature": 0.5,
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "sh", "parameters": SCHEMA}}],
        },
        ("messages",),
    ),
    Endpoint(
        "responses",
        "/v1/responses",
        {
            "model": "m",
            "instructions": "s",
            "max_output_tokens": 64,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "tools": [{"type": "function", "name": "sh", "parameters": SCHEMA}],
        },
        ("input",),
    ),
    Endpoint(
        "messages",
        "/v1/messages?beta=true",
        {
            "model": "m",
            "max_tokens": 64,
            "stream": True,
            "system": [{"type": "text", "text": "s"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "tools": [{"name": "sh", "input_schema": SCHEMA}],
        },
        ("messages",),
    ),
    Endpoint(
        "count_tokens",
        "/v1/messages/count_tokens",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        ("messages",),
    ),
    Endpoint(
        "generateContent",
        "/v1beta/models/m:generateContent",
        {
            "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
            "generationConfig": {"maxOutputTokens": 64, "temperature": 0.5},
            "tools": [{"functionDeclarations": [{"name": "sh", "parametersJsonSchema": SCHEMA}]}],
        },
        ("contents",),
    ),
    Endpoint(
        "streamGenerateContent",
        "/v1/models/m:streamGenerateContent?alt=sse",
        {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
        ("contents",),
    ),
    Endpoint(
        "countTokens",
        "/v1beta/models/m:countTokens",
        {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
        ("contents",),
    ),
    Endpoint(
        "update_weights",
        "/admin/update_weights",
        {"model_path": "/nonexistent/checkpoint", "version": "9"},
        ("model_path",),
        admin=True,
    ),
)


# -- bad requests ----------------------------------------------------------------------
@dataclass(frozen=True)
class Bad:
    kind: str
    body: bytes
    token: str | None = None  # None: the session's (or admin) token
    in_path: bool = True


# Tool argument schemas are the harness's own JSON, passed to the model as they are. A
# block, item or tool of an unknown ``type`` is dropped or offered as best the proxy can
# (forward compatibility, HARNESSES.md), so a strange ``type`` is not bad input.
OPAQUE = ("parameters", "input_schema", "parametersJsonSchema")


def paths_of(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix and prefix[-1] != "type" else []
    if prefix and prefix[-1] in OPAQUE:
        return out
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths_of(v, (*prefix, i))
    return out


def replaced(body: Any, path: tuple, value: Any, *, delete: bool = False) -> Any:
    body = orjson.loads(orjson.dumps(body))
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return body


_TYPES = {
    "int": st.integers(-(2**40), 2**40),
    "bool": st.booleans(),
    "str": st.text(max_size=8),
    "list": st.lists(st.integers(-9, 9), max_size=3),
    "dict": st.dictionaries(st.sampled_from(["x", "type", "text"]), st.integers(-9, 9), max_size=2),
}


def _kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "int"
    return {str: "str", list: "list", dict: "dict"}[type(value)]


# A value of another JSON type is wrong everywhere, except these equivalent spellings.
_SAME = {("content", "str", "list"), ("content", "list", "str"), ("system", "list", "str")}
_SAME |= {("input", "list", "str"), ("system", "str", "list"), ("instructions", "str", "list")}


@st.composite
def wrong_type(draw, ep: Endpoint) -> Bad:
    path = draw(st.sampled_from(paths_of(ep.body)))
    old = _kind_of(_value_at(ep.body, path))
    name = next((k for k in reversed(path) if isinstance(k, str)), "")
    kinds = [k for k in _TYPES if k != old and (name, old, k) not in _SAME]
    new = draw(st.sampled_from(kinds))
    return Bad("wrong_type", orjson.dumps(replaced(ep.body, path, draw(_TYPES[new]))))


def _value_at(body: Any, path: tuple) -> Any:
    for key in path:
        body = body[key]
    return body


@st.composite
def missing_field(draw, ep: Endpoint) -> Bad:
    field = draw(st.sampled_from(ep.required))
    return Bad("missing_field", orjson.dumps(replaced(ep.body, (field,), None, delete=True)))


@st.composite
def out_of_range(draw, ep: Endpoint) -> Bad:
    """Values of the right type that no engine can serve."""
    spots = [p for p in paths_of(ep.body) if p[-1] in _RANGES]
    if not spots:
        return draw(missing_field(ep))
    path = draw(st.sampled_from(spots))
    value = draw(_RANGES[path[-1]])
    body = json.dumps(replaced(ep.body, path, value)).encode()  # orjson: 64-bit ints only
    return Bad("out_of_range", body)


# Counts past any context window, as JSON ints and as floats (``1e308`` was a 500:
# "Integer exceeds 64-bit range" encoding the engine request, issue 17.7).
_TOO_MANY = st.integers(2**31, 10**40) | st.floats(2.0**53, 1e308)
_COUNTS = st.integers(-(2**31), 0) | _TOO_MANY

_RANGES = {
    "max_tokens": _COUNTS,
    "max_output_tokens": _COUNTS,
    "maxOutputTokens": _COUNTS,
    "temperature": st.floats(-1e6, -0.01),
    "role": st.sampled_from(["robot", "tool_result", "ASSISTANT", "assistant "]),
}


def malformed() -> st.SearchStrategy[Bad]:
    junk = st.binary(max_size=200).filter(_not_json_object)
    text = st.text(max_size=60).map(str.encode).filter(_not_json_object)
    return (junk | text).map(lambda b: Bad("malformed_json", b))


def _not_json_object(raw: bytes) -> bool:
    try:
        return not isinstance(orjson.loads(raw), dict)
    except orjson.JSONDecodeError:
        return True


def not_an_object() -> st.SearchStrategy[Bad]:
    ints = st.integers(-(2**63), 2**63 - 1)
    values = st.lists(ints, max_size=3) | ints | st.text(max_size=10)
    return (values | st.none()).map(lambda v: Bad("not_an_object", orjson.dumps(v)))


def huge() -> st.SearchStrategy[Bad]:
    def make(size: int, as_json: bool) -> Bad:
        body = orjson.dumps({"messages": ["x" * size]}) if as_json else b"\x00" * size
        return Bad("huge_body", body)

    return st.builds(make, st.integers(LIMIT + 1, 2 * LIMIT), st.booleans())


def unknown_token(ep: Endpoint) -> st.SearchStrategy[Bad]:
    tokens = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40)
    return st.builds(
        lambda t, p: Bad("unknown_token", orjson.dumps(ep.body), token="ps_" + t, in_path=p),
        tokens,
        st.booleans(),
    )


def bad_requests(ep: Endpoint) -> st.SearchStrategy[Bad]:
    """Every kind about equally often (wrong types twice: they have the most shapes)."""
    kinds = [
        malformed(),
        not_an_object(),
        missing_field(ep),
        wrong_type(ep),
        wrong_type(ep),
        out_of_range(ep),
        huge(),
        unknown_token(ep),
    ]
    return st.sampled_from(range(len(kinds))).flatmap(lambda i: kinds[i])


def send(client: httpx.Client, ep: Endpoint, bad: Bad, token: str) -> httpx.Response:
    if ep.admin:
        auth = {"authorization": f"Bearer {bad.token or ADMIN}"}
        return client.post(ep.path, content=bad.body, headers=auth)
    token = bad.token or token
    if bad.in_path:
        path = f"/s/{urllib.parse.quote(token, safe='')}{ep.path}"
        return client.post(path, content=bad.body)
    return client.post(ep.path, content=bad.body, headers={"x-api-key": token})


# -- the service under test -------------------------------------------------------------
@pytest.fixture(scope="module")
def proxy(engine, nats_url, redis_url, tmp_path_factory):
    options = {"max_body_bytes": LIMIT, "admin_token": ADMIN, "keepalive_seconds": KEEPALIVE}
    with proxy_process(nats_url, redis_url, engine, tmp_path_factory.mktemp("p"), **options) as p:
        yield p


def engine_tokens(engine) -> int:
    return httpx.get(engine.url + "/server_info").json()["internal_states"][0]["generated_tokens"]


async def session_with_calls(proxy, nats_url, redis_url, task_id: str):
    import redis.asyncio as aioredis

    redis = aioredis.from_url(redis_url)
    bus = await Bus.open(nats_url, "test-fuzz")
    try:
        session = await new_session(redis, task_id)
        await run_loop(ChatAgent(proxy.url, session.token), 3)
        return session, await captured(bus, session.session_id, expect=3)
    finally:
        await bus.close()
        await redis.aclose()


async def records_of(nats_url, session_id: str, expect: int):
    bus = await Bus.open(nats_url, "test-fuzz")
    try:
        return await captured(bus, session_id, expect=expect)
    finally:
        await bus.close()


def fuzz_endpoint(client: httpx.Client, ep: Endpoint, token: str, seen: Counter) -> None:
    @FUZZ
    @given(bad=bad_requests(ep))
    def fuzz(bad: Bad) -> None:
        r = send(client, ep, bad, token)
        assert 400 <= r.status_code < 500, (ep.name, bad, r.status_code, r.text[:300])
        if bad.kind == "huge_body" and not ep.admin:
            assert r.status_code == 413
        if bad.kind == "unknown_token":
            assert r.status_code in (401, 404), (bad, r.status_code)  # 404: "/" in it
        seen[(ep.name, bad.kind, r.status_code)] += 1

    fuzz()


def test_bad_input_at_every_endpoint_is_a_4xx_and_leaves_records_untouched(
    proxy, engine, nats_url, redis_url
):
    session, before = asyncio.run(session_with_calls(proxy, nats_url, redis_url, "fuzz"))
    assert len(before) == 3
    tokens = engine_tokens(engine)
    seen: Counter = Counter()
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        for ep in ENDPOINTS:
            fuzz_endpoint(client, ep, session.token, seen)
        # GET endpoints: any model id, with and without a valid token
        for path in ("/v1/models/{}", "/v1beta/models/{}"):
            for model_id in ("m", "../../etc", "%00", "a" * 3000, "models/x:y"):
                r = client.get(f"/s/{session.token}" + path.format(model_id))
                assert r.status_code < 500, (path, model_id, r.status_code)
                r = client.get(path.format(model_id), headers={"x-api-key": "nope"})
                assert r.status_code in (401, 404), (path, model_id, r.status_code)
        assert client.get("/healthz").status_code == 200
    assert proxy.proc.poll() is None
    assert engine_tokens(engine) == tokens  # no bad request reached the model
    after = asyncio.run(records_of(nats_url, session.session_id, expect=3))
    assert [encode(r) for r in after] == [encode(r) for r in before]
    by_kind, by_class = Counter(), Counter()
    for (_, kind, status), n in seen.items():
        by_kind[kind] += n
        by_class[f"{status // 100}xx"] += n
    print("\nfuzzed requests by kind:", dict(by_kind), "total", sum(by_kind.values()))
    print(f"requests {sum(by_class.values())}, 4xx {by_class['4xx']}, 5xx {by_class['5xx']}")
    # the session still works afterwards
    client = openai.OpenAI(base_url=f"{proxy.url}/s/{session.token}/v1", api_key="x", max_retries=0)
    ok = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.tool_calls


# -- long calls ---------------------------------------------------------------------------
SLOW = [{"role": "user", "content": "SLOW REPLY please"}]


def engine_state(engine) -> dict:
    return httpx.get(engine.url + "/server_info").json()["internal_states"][0]


async def raw_stream_timeline(url: str, body: dict) -> list[tuple[float, bytes]]:
    """(seconds since the request, chunk) for every chunk of an SSE answer."""
    out = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=1.0)) as client:
        t0 = asyncio.get_running_loop().time()
        async with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_raw():
                out.append((asyncio.get_running_loop().time() - t0, chunk))
    return out


async def test_keepalives_outlast_client_idle_timeouts(proxy, redis_client, bus):
    a, b = await new_session(redis_client, "slow-a"), await new_session(redis_client, "slow-b")
    # The call's length depends on the CPU (500-2,600 tokens/s on the machines seen so
    # far: ~1.7-9 s for these 4,500), so the client's idle timeout is set well below it,
    # keep-alives come every 0.1 s, and the assertions are relative to that timeout: the
    # call outlasts it by half again while no silence reaches it (a stall of this loaded
    # test process under 0.4 s does not read as one).
    idle_timeout, tokens = 0.5, 4500
    anthropic_body = {"model": "m", "max_tokens": tokens, "stream": True, "messages": SLOW}
    sdk = openai.AsyncOpenAI(
        base_url=f"{proxy.url}/s/{b.token}/v1",
        api_key="x",
        max_retries=0,
        # the SDK's own Timeout: newer openai releases run on httpx2, which rejects httpx's
        timeout=openai.Timeout(60, read=idle_timeout),
    )
    stream = sdk.chat.completions.create(model="m", messages=SLOW, max_tokens=tokens, stream=True)
    timeline, chunks = await asyncio.gather(
        raw_stream_timeline(f"{proxy.url}/s/{a.token}/v1/messages", anthropic_body),
        _collect(stream),
    )
    took = timeline[-1][0]
    gaps = [t2 - t1 for (t1, _), (t2, _) in zip(timeline, timeline[1:], strict=False)]
    pings = sum(c.count(b"event: ping") for _, c in timeline)
    assert took > 1.5 * idle_timeout and max([timeline[0][0], *gaps]) < idle_timeout, (
        took,
        max(gaps),
    )
    assert pings >= 4 and b"event: message_stop" in timeline[-1][1]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.count("\N{TURTLE}") > 100
    for session in (a, b):
        (rec,) = await captured(bus, session.session_id, expect=1)
        assert rec.finish_reason == "length" and len(rec.output_ids) == tokens and not rec.aborted
    print(f"\nslow call: {took:.1f}s, {pings} pings, longest silence {max(gaps):.2f}s")


async def _collect(stream_coro) -> list:
    return [c async for c in await stream_coro]


async def wait_generating(engine, since: int, timeout: float = 10.0) -> None:
    """Until the engine has generated a few tokens more than ``since``."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with httpx.AsyncClient() as c:
        while True:
            state = (await c.get(engine.url + "/server_info")).json()["internal_states"][0]
            if state["generated_tokens"] >= since + 8:
                return
            assert asyncio.get_running_loop().time() < deadline, state
            await asyncio.sleep(0.005)


async def wait_idle(engine, timeout: float = 20.0) -> dict:  # an abort under load is slow
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        async with httpx.AsyncClient() as c:
            state = (await c.get(engine.url + "/server_info")).json()["internal_states"][0]
        if state["running"] == 0 and state["waiting"] == 0:
            return state
        assert asyncio.get_running_loop().time() < deadline, state
        await asyncio.sleep(0.1)


async def test_hanging_up_cancels_the_engine_request_and_records_an_abort(
    proxy, engine, redis_client, bus
):
    streamed, plain = (
        await new_session(redis_client, "hangup-a"),
        await new_session(redis_client, "hangup-b"),
    )
    before = (await wait_idle(engine))["generated_tokens"]
    body = {"model": "m", "stream": True, "messages": SLOW}
    keepalives = 0
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream(
            "POST", f"{proxy.url}/s/{streamed.token}/v1/chat/completions", json=body
        ) as r,
    ):
        assert r.status_code == 200
        async for chunk in r.aiter_raw():
            keepalives += chunk.count(b": keep-alive")
            if keepalives >= 1:
                break  # the harness hangs up mid-call
    middle = (await wait_idle(engine))["generated_tokens"]
    # A plain (non-streaming) call, abandoned once the engine is generating it: hung up
    # on the engine's progress, not after a fixed time (a fast CPU writes the whole
    # 4,800 tokens in about 2 s).
    async with httpx.AsyncClient(timeout=30) as client:
        call = asyncio.create_task(
            client.post(
                f"{proxy.url}/s/{plain.token}/v1/chat/completions",
                json={"model": "m", "messages": SLOW},
            )
        )
        await wait_generating(engine, since=middle)
        call.cancel()  # closes the connection: the harness hangs up mid-call
        with pytest.raises(asyncio.CancelledError):
            await call
    after = (await wait_idle(engine))["generated_tokens"]
    # each engine request stopped early (the reply is 4,800 tokens); one at a time, so
    # each call's count is its own
    assert middle - before < 1500 and after - middle < 1500, (middle - before, after - middle)
    for session in (streamed, plain):
        (rec,) = await captured(bus, session.session_id, expect=1)
        assert rec.aborted and rec.finish_reason == "abort" and rec.output_ids == []
        assert len(rec.prompt_ids) > 10  # token mode knows the prompt it was serving
    async with httpx.AsyncClient() as c:
        text = (await c.get(proxy.url + "/metrics")).text
    assert 'polar_proxy_calls_total{protocol="openai_chat",result="aborted"} 2.0' in text
    print(
        f"\nengine tokens of two abandoned 4,800-token calls: {middle - before}, {after - middle}"
    )
