"""Side-call tags on requests shaped like the harnesses' own (HARNESSES.md), parsed by
each protocol's real parser: the calls builders must keep out of the main chain."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from proxy.protocols import anthropic_messages, gemini, openai_chat, openai_responses
from proxy.sidecalls import classify

SHELL = {"type": "object", "properties": {"command": {"type": "string"}}}


def chat(body: dict) -> str | None:
    return classify("openai_chat", openai_chat.parse_request(body, {}, {}))


def claude(body: dict) -> str | None:
    return classify("anthropic_messages", anthropic_messages.parse_request(body, {}, {}))


def gem(body: dict, action: str = "generateContent") -> str | None:
    conv = gemini.parse_request(body, {"target": f"gemini-2.5-flash:{action}"}, {})
    return classify("gemini", conv)


def codex(body: dict) -> str | None:
    return classify("openai_responses", openai_responses.parse_request(body, {}, {}))


OPENCODE_TITLE = {
    "model": "tiny",
    "stream": True,
    "max_tokens": 32000,
    "messages": [
        {
            "role": "system",
            "content": "You are a title generator. You output ONLY a thread title. Nothing else.",
        },
        {"role": "user", "content": "Generate a title for this conversation:\n"},
        {"role": "user", "content": "write proof into proof.txt"},
    ],
}
OPENCODE_MAIN = {
    "model": "tiny",
    "stream": True,
    "messages": [
        {"role": "system", "content": "You are opencode, an interactive CLI tool."},
        {"role": "user", "content": "write proof into proof.txt"},
    ],
    "tools": [{"type": "function", "function": {"name": "bash", "parameters": SHELL}}],
}
GEMINI_ROUTER = {
    "contents": [{"role": "user", "parts": [{"text": "write proof into proof.txt"}]}],
    "systemInstruction": {"parts": [{"text": "You are a Task Routing AI. Choose a model."}]},
    "generationConfig": {
        "temperature": 0,
        "responseMimeType": "application/json",
        "responseJsonSchema": {
            "type": "object",
            "properties": {"reasoning": {"type": "string"}, "model_choice": {"type": "string"}},
            "required": ["reasoning", "model_choice"],
        },
    },
}
GEMINI_MAIN = {
    "contents": [{"role": "user", "parts": [{"text": "write proof into proof.txt"}]}],
    "systemInstruction": {"parts": [{"text": "You are an interactive CLI agent."}]},
    "tools": [
        {"functionDeclarations": [{"name": "run_shell_command", "parametersJsonSchema": SHELL}]}
    ],
}
CLAUDE_PROBE = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 1,
    "messages": [{"role": "user", "content": "quota"}],
    "metadata": {"user_id": "user_abc"},
}
CLAUDE_MAIN = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 32000,
    "stream": True,
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.300; cch=1a2b;"},
        {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
    ],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "write proof"}]}],
    "tools": [{"name": "Bash", "input_schema": SHELL}],
    "thinking": {"type": "enabled", "budget_tokens": 31999},
}


def test_opencode_title_call_is_tagged_and_its_main_loop_is_not():
    assert chat(OPENCODE_TITLE) == "title"
    assert chat(OPENCODE_MAIN) is None


def test_gemini_cli_router_call_is_tagged_and_its_main_loop_is_not():
    assert gem(GEMINI_ROUTER) == "router"
    with_schema = {**GEMINI_ROUTER, "generationConfig": {"responseSchema": {"type": "OBJECT"}}}
    assert gem(with_schema) == "router"  # the older OpenAPI-style schema too
    assert gem(GEMINI_MAIN, "streamGenerateContent") is None


def test_claude_code_probe_is_tagged_and_its_main_loop_is_not():
    assert claude(CLAUDE_PROBE) == "probe"
    assert claude(CLAUDE_MAIN) is None


def test_main_loop_calls_that_look_like_side_calls_stay_main():
    # a tool-using call mentioning titles, or asking for JSON, is still the agent's loop
    titled = {**OPENCODE_MAIN, "messages": [{"role": "user", "content": "fix the title bar"}]}
    assert chat(titled) is None
    json_mode = {**OPENCODE_MAIN, "response_format": {"type": "json_object"}}
    assert chat(json_mode) is None
    assert codex({"model": "m", "input": "make a title", "tools": [_responses_tool()]}) is None


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_probe_threshold(max_tokens):
    body = {**CLAUDE_MAIN, "max_tokens": max_tokens}
    assert claude(body) == ("probe" if max_tokens == 1 else None)


def _responses_tool() -> dict:
    return {"type": "function", "name": "exec_command", "parameters": SHELL}


FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "completions"
PARSERS = {"openai_chat": chat, "openai_responses": codex, "anthropic_messages": claude}


@pytest.mark.parametrize(
    ("fixture", "tags"),
    [
        ("side_calls", ["title", None, None, None]),  # opencode: title first
        ("compaction", [None, None, "compaction", None, None, None]),  # Codex auto-compaction
        ("sub_agent", [None] * 10),  # Claude Code's loop and its sub-agents: all real work
    ],
)
def test_recorded_requests_of_real_clis(fixture, tags):
    """Codex's instructions mention "Title Case" far down: its summarization request is a
    compaction, not a title; opencode's title generator says so up front."""
    lines = (FIXTURES / f"{fixture}.jsonl").read_bytes().splitlines()
    got = []
    for line in lines:
        rec = orjson.loads(line)
        got.append(PARSERS[rec["protocol"]](rec["raw_request"]))
    assert got == tags
