"""Shared test doubles for the app tests: a session table and scripted model answers."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from proxy.app import SessionInfo, unprepared
from proxy.conversation import AssistantTurn, Conversation, ToolCall, Usage

TOKEN = "tok-3f9a1c"
SESSION = SessionInfo(session_id="task1-0000", model="served-model")

TOOL_TURN = AssistantTurn(
    reasoning="thinking",
    text="Running it.",
    tool_calls=[ToolCall("", "shell", '{"command":"echo proof > proof.txt"}')],
    finish_reason="tool_calls",
    usage=Usage(prompt_tokens=20, completion_tokens=7),
)
TEXT_TURN = AssistantTurn(text="Done.", usage=Usage(prompt_tokens=40, completion_tokens=2))


async def resolve(token: str, for_call: bool = False) -> SessionInfo | None:
    return SESSION if token == TOKEN else None


@dataclass
class Scripted:
    """A completion handler whose answer, delay and failure the test sets."""

    turn: AssistantTurn = TOOL_TURN
    delay: float = 0.0
    error: BaseException | None = None
    calls: list[tuple[SessionInfo, Conversation, str, bytes, Mapping[str, str]]] = field(
        default_factory=list
    )
    cancelled: int = 0

    def reset(self) -> None:
        self.turn, self.delay, self.error, self.calls, self.cancelled = TOOL_TURN, 0.0, None, [], 0

    async def __call__(
        self,
        session: SessionInfo,
        conv: Conversation,
        protocol: str,
        raw: bytes,
        headers: Mapping[str, str],
    ) -> AssistantTurn:
        self.calls.append((session, conv, protocol, raw, headers))
        # What every backend does first: encode the request for the engine (orjson, as
        # proxy.backends.http). A value it cannot encode must have been a 4xx already.
        orjson.dumps(msgspec.to_builtins(conv))
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.error is not None:
            raise self.error
        return self.turn

    def prepare(self, conv: Conversation, protocol: str, raw: bytes, headers: Mapping[str, str]):
        """The two-step shape ``create_app`` takes (nothing to prepare)."""
        return unprepared(self)(conv, protocol, raw, headers)


# One minimal valid request per generation endpoint: (path, body, stream flag key)
CHAT = (
    "/v1/chat/completions",
    {"model": "harness-model", "messages": [{"role": "user", "content": "hi"}]},
)
RESPONSES = ("/v1/responses", {"model": "harness-model", "input": "hi"})
MESSAGES = (
    "/v1/messages?beta=true",
    {"model": "harness-model", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
)
GEMINI = (
    "/v1beta/models/harness-model:generateContent",
    {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
)
GEMINI_STREAM = ("/v1beta/models/harness-model:streamGenerateContent?alt=sse", GEMINI[1])
GENERATE = {
    "openai_chat": CHAT,
    "openai_responses": RESPONSES,
    "anthropic_messages": MESSAGES,
    "gemini": GEMINI,
}


def streaming(protocol: str) -> tuple[str, dict[str, Any]]:
    if protocol == "gemini":
        return GEMINI_STREAM
    path, body = GENERATE[protocol]
    return path, {**body, "stream": True}


def protocol_shaped(protocol: str, body: dict[str, Any]) -> bool:
    """Is ``body`` an error in exactly that protocol's shape?"""
    if protocol == "anthropic_messages":
        return body["type"] == "error" and set(body["error"]) == {"type", "message"}
    if protocol == "gemini":
        return set(body["error"]) == {"code", "message", "status"}
    return set(body["error"]) == {"message", "type", "param", "code"}
