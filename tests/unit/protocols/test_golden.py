"""Each protocol against its golden cases: request -> Conversation, turn -> JSON and SSE."""

from __future__ import annotations

import msgspec
import pytest

from proxy.sse import encode_all, parse
from tests.unit.protocols.golden import IDS, Case, cases

CASES = cases()


def test_there_are_cases_for_every_protocol() -> None:
    protocols = {c.dir.parent.name for c in CASES}
    assert protocols == {"openai_chat", "openai_responses", "anthropic_messages", "gemini"}
    assert len(CASES) >= 12


@pytest.mark.parametrize("case", CASES, ids=str)
def test_parse_request(case: Case) -> None:
    conv = msgspec.to_builtins(case.parse())
    assert conv == case.expect_json("conversation.json", conv)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_render_response(case: Case) -> None:
    conv = case.parse()
    assert case.spec.render_response is not None
    body = case.spec.render_response(case.turn, conv, IDS)
    assert body == case.expect_json("response.json", body)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_render_stream(case: Case) -> None:
    conv = case.parse()
    assert case.spec.render_stream is not None
    events = list(case.spec.render_stream(case.turn, conv, IDS))
    data = encode_all(events)
    assert data == case.expect_bytes("stream.sse", data)
    assert parse([data]) == events
