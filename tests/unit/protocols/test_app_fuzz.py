"""Fuzzing every endpoint: whatever a client sends, the reply is a well-formed 2xx/4xx in
its protocol — never a 5xx, never a crash, never the parser's catch-all."""

from __future__ import annotations

import json
import urllib.parse
from collections import Counter
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient

from proxy.app import create_app
from proxy.sse import parse
from tests.unit.protocols.app_support import TOKEN, Scripted, protocol_shaped, resolve
from tests.unit.protocols.golden import cases

LIMIT = 16 * 1024
# derandomized: the same examples every run (deterministic CI), no example database on disk
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# (protocol, path) for every POST endpoint
ENDPOINTS = [
    ("openai_chat", "/v1/chat/completions"),
    ("openai_responses", "/v1/responses"),
    ("anthropic_messages", "/v1/messages?beta=true"),
    ("anthropic_messages", "/v1/messages/count_tokens"),
    ("gemini", "/v1beta/models/gemini-2.5-pro:generateContent"),
    ("gemini", "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"),
    ("gemini", "/v1beta/models/gemini-2.5-pro:countTokens"),
]
SEEDS = {p: [c.request for c in cases() if c.dir.parent.name == p] for p, _ in ENDPOINTS}

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def client():
    with TestClient(
        create_app(Scripted().prepare, resolve, max_body_bytes=LIMIT, keepalive_seconds=5)
    ) as c:
        yield c


def paths_of(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths_of(v, (*prefix, i))
    return out


def mutate(body: Any, path: tuple, replacement: Any, delete: bool) -> Any:
    if not path:
        return replacement
    body = orjson.loads(orjson.dumps(body))
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    return body


@st.composite
def mutated_seed(draw: st.DrawFn, protocol: str) -> Any:
    body = draw(st.sampled_from(SEEDS[protocol]))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths_of(body)))
        body = mutate(body, path, draw(json_values), delete=bool(path) and draw(st.booleans()))
    return body


TALLY: Counter = Counter()  # status class of every fuzzed request, printed at the end


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    total = sum(TALLY.values())
    print(f"\nfuzzed requests {total}: 2xx {TALLY[2]}, 4xx {TALLY[4]}, 5xx {TALLY[5]}")


def check(protocol: str, r: Any) -> None:
    TALLY[r.status_code // 100] += 1
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert parse([r.content])
        return
    body = r.json()
    if r.status_code >= 400:
        assert protocol_shaped(protocol, body), body
        assert not body["error"]["message"].startswith("malformed request"), body  # a parser gap


@given(endpoint=st.sampled_from(ENDPOINTS), data=st.data())
@FUZZ
def test_mutated_realistic_requests(client, endpoint, data) -> None:
    protocol, path = endpoint
    body = data.draw(mutated_seed(protocol))
    check(protocol, client.post(path, content=orjson.dumps(body), headers={"x-api-key": TOKEN}))


@given(endpoint=st.sampled_from(ENDPOINTS), body=json_values)
@FUZZ
def test_arbitrary_json(client, endpoint, body) -> None:
    protocol, path = endpoint
    check(protocol, client.post(path, content=orjson.dumps(body), headers={"x-api-key": TOKEN}))


@given(endpoint=st.sampled_from(ENDPOINTS), raw=st.binary(max_size=300))
@FUZZ
def test_malformed_bytes(client, endpoint, raw) -> None:
    protocol, path = endpoint
    r = client.post(path, content=raw, headers={"x-api-key": TOKEN})
    check(protocol, r)
    assert r.status_code == 400


# The token-count field of each generation endpoint (the body's key path).
COUNT_FIELDS = {
    "openai_chat": ("max_tokens",),
    "openai_responses": ("max_output_tokens",),
    "anthropic_messages": ("max_tokens",),
    "gemini": ("generationConfig", "maxOutputTokens"),
}
GENERATE = [(p, path) for p, path in ENDPOINTS if "count" not in path.lower()]


@given(
    endpoint=st.sampled_from(GENERATE),
    value=st.sampled_from([1e308, 2.0**64, 2**63, 2**64, 10**30, 2**31, -(2**64)])
    | st.floats(2.0**53, 1e308)
    | st.integers(2**31, 10**40),
)
@settings(FUZZ, max_examples=60)
def test_token_counts_past_any_engine_are_400(client, endpoint, value) -> None:
    # issue 17.7: max_tokens 1e308 was a 500 ("Integer exceeds 64-bit range" encoding
    # the engine request) on chat and messages
    protocol, path = endpoint
    body = orjson.loads(orjson.dumps(SEEDS[protocol][0]))
    *parents, leaf = COUNT_FIELDS[protocol]
    cur = body
    for key in parents:
        cur = cur.setdefault(key, {})
    cur[leaf] = value
    raw = json.dumps(body).encode()  # orjson cannot even write the bigger ints
    r = client.post(path, content=raw, headers={"x-api-key": TOKEN})
    check(protocol, r)
    assert r.status_code == 400


@given(
    endpoint=st.sampled_from(ENDPOINTS),
    size=st.integers(LIMIT + 1, 3 * LIMIT),
    as_json=st.booleans(),
)
@settings(FUZZ, max_examples=30)
def test_huge_bodies_are_413(client, endpoint, size, as_json) -> None:
    protocol, path = endpoint
    raw = orjson.dumps({"messages": ["x" * size]}) if as_json else b"\xff" * size
    r = client.post(path, content=raw, headers={"x-api-key": TOKEN})
    assert r.status_code == 413 and protocol_shaped(protocol, r.json())


@given(
    endpoint=st.sampled_from(ENDPOINTS),
    token=st.text(min_size=1, max_size=40),
    where=st.sampled_from(["path", "bearer", "x-api-key", "x-goog-api-key"]),
)
@FUZZ
def test_unknown_tokens_are_401(client, endpoint, token, where) -> None:
    protocol, path = endpoint
    if token.strip() == TOKEN:
        return
    body = orjson.dumps(SEEDS[protocol][0])
    if where == "path":
        r = client.post(f"/s/{urllib.parse.quote(token, safe='')}{path}", content=body)
    else:
        value = f"Bearer {token}" if where == "bearer" else token
        try:
            r = client.post(
                path, content=body, headers={"authorization" if where == "bearer" else where: value}
            )
        except (UnicodeEncodeError, ValueError):
            return  # not sendable as an HTTP header at all
    assert r.status_code in (401, 404), r.text  # 404: a token with "/" that no route matches
    if r.status_code == 401:
        assert protocol_shaped(protocol, r.json())


@pytest.mark.parametrize(("protocol", "path"), ENDPOINTS)
def test_missing_required_fields(client, protocol, path) -> None:
    for body in ({}, {"model": "m"}, {"messages": None}, {"input": None}, {"contents": {}}):
        check(protocol, client.post(path, content=orjson.dumps(body), headers={"x-api-key": TOKEN}))
