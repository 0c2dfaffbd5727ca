"""The app the SDK tests serve under granian: the real proxy app with a scripted model.

The model double calls the first tool it is offered, then answers with the tool's
result; a prompt containing "pause" delays the answer past a few keep-alives, and one
containing "slow" makes it wait (and leave a marker file when it is cancelled, so the
test can see a disconnect cancel the engine call). Kept apart from the
test module so the server process starts without importing the SDKs.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

from proxy.app import SessionInfo, create_app, unprepared
from proxy.conversation import AssistantTurn, Conversation, TextPart, ToolCall, Usage
from proxy.main import ops_routes

TOKEN = "sdk-test-7d2e91b0"
ARGS = {"command": "echo proof > proof.txt"}


async def scripted_model(
    session: SessionInfo, conv: Conversation, protocol: str, raw: bytes, headers: Mapping[str, str]
) -> AssistantTurn:
    last = conv.messages[-1]
    text = "".join(p.text for p in last.content if isinstance(p, TextPart))
    usage = Usage(prompt_tokens=len(conv.messages), completion_tokens=5)
    if "slow" in text:
        await _slow(protocol)
    if "pause" in text:
        await asyncio.sleep(0.7)  # past the 0.2 s keep-alive interval: keep-alives go first
    if last.role == "tool":
        return AssistantTurn(text=f"The tool said: {text}", usage=usage)
    callable_tools = [t for t in conv.tools if t.kind != "other"]
    if callable_tools:
        call = ToolCall("", callable_tools[0].name, json.dumps(ARGS))
        return AssistantTurn(
            reasoning="I should run it.", tool_calls=[call], finish_reason="tool_calls", usage=usage
        )
    return AssistantTurn(text="Hello from the proxy.", usage=usage)


async def _slow(protocol: str) -> None:
    marker = Path(os.environ["POLAR_TEST_MARKERS"]) / f"cancelled-{protocol}-{time.monotonic_ns()}"
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        marker.write_text("cancelled")
        raise


async def resolve(token: str, for_call: bool = False) -> SessionInfo | None:
    return SessionInfo(session_id="sdk-0000", model="served-model") if token == TOKEN else None


MAX_BODY_BYTES = 1_000_000  # small, so a test can send more than that cheaply


async def health() -> dict[str, object]:
    return {"scripted_model": True}


def make_app():  # granian factory target
    return create_app(
        unprepared(scripted_model),
        resolve,
        keepalive_seconds=0.2,
        max_body_bytes=MAX_BODY_BYTES,
        operator_routes=ops_routes("proxy-sdk-test", health),
    )
