"""Agent loops for the proxy's end-to-end tests, one per wire protocol.

Each agent drives the proxy with that protocol's official async SDK and keeps its history
the way that protocol's clients do: the model's turn is echoed back as the SDK returned
it (reasoning included, unless ``echo_reasoning=False``, as many clients do), then the
tool's result in the protocol's own shape. The tool is a shell tool, ``exec_command
{cmd}``, declared in each protocol's native tool format. The model behind the proxy
follows ``tests/fixtures/policies/tool_loop.yaml``: tool calls until a tool result says
ALL DONE, then a final answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
from google import genai
from google.genai import types as gt

from schemas import CompletionRecord, decode
from schemas import subjects as S

MODEL = "harness-model"
SYSTEM = "You are a coding agent in /repo. Run shell commands with exec_command."
TASK = "The test suite fails. Find out why and fix it."
TOOL = "exec_command"
SCHEMA = {
    "type": "object",
    "properties": {
        "cmd": {"type": "string", "description": "shell command"},
        "workdir": {"type": "string"},
        "timeout_ms": {"type": "integer"},
    },
    "required": ["cmd"],
}


@dataclass(frozen=True)
class Step:
    text: str
    reasoning: str
    call: tuple[str, dict[str, Any]] | None  # (name, arguments) of the tool call, if any


def tool_output(i: int, *, last: bool) -> str:
    """What the shell 'printed' after call ``i``; the last one ends the loop."""
    if last:
        return f"{i + 1} passed in 0.12s\nALL DONE"
    return f'step {i}: {i * 3} files\nnaïve café ✓ {{"ok": true, "n": {i}}}\n'


async def run_loop(agent, turns: int = 30, *, stream_every: int = 2) -> list[Step]:
    """``turns`` calls: tool calls answered with tool output, the last answer final."""
    steps: list[Step] = []
    for i in range(turns):
        step = await agent.step(stream=stream_every > 0 and i % stream_every == 1)
        steps.append(step)
        if step.call is None:
            break
        agent.add_result(tool_output(i, last=i == turns - 2))
    return steps


def session_url(proxy_url: str, token: str) -> str:
    return f"{proxy_url}/s/{token}"


# -- OpenAI Chat Completions (Qwen Code, opencode, pi) ------------------------------------
class ChatAgent:
    protocol = "openai_chat"

    def __init__(self, proxy_url: str, token: str, *, echo_reasoning: bool = True) -> None:
        self.client = openai.AsyncOpenAI(
            base_url=session_url(proxy_url, token) + "/v1", api_key="unused", max_retries=0
        )
        self.echo_reasoning = echo_reasoning
        self.tools = [
            {
                "type": "function",
                "function": {"name": TOOL, "description": "run a command", "parameters": SCHEMA},
            }
        ]
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": TASK},
        ]
        self.call_id = ""

    async def step(self, *, stream: bool) -> Step:
        kw = {"model": MODEL, "messages": self.messages, "tools": self.tools}
        if stream:
            async with self.client.chat.completions.stream(**kw) as s:
                done = await s.get_final_completion()
        else:
            done = await self.client.chat.completions.create(**kw)
        msg = done.choices[0].message
        echo = msg.model_dump(exclude_none=True)
        reasoning = echo.get("reasoning_content") or ""
        if not self.echo_reasoning:
            echo.pop("reasoning_content", None)
        self.messages.append(echo)
        call = None
        if msg.tool_calls:
            fn = msg.tool_calls[0].function
            call, self.call_id = (fn.name, json.loads(fn.arguments)), msg.tool_calls[0].id
        return Step(msg.content or "", reasoning, call)

    def add_result(self, output: str) -> None:
        # Qwen Code sends tool results as an array of parts
        content = [{"type": "text", "text": output}]
        self.messages.append({"role": "tool", "tool_call_id": self.call_id, "content": content})


# -- OpenAI Responses (Codex CLI) --------------------------------------------------------
class ResponsesAgent:
    protocol = "openai_responses"

    def __init__(self, proxy_url: str, token: str, *, echo_reasoning: bool = True) -> None:
        self.client = openai.AsyncOpenAI(
            base_url=session_url(proxy_url, token) + "/v1", api_key="unused", max_retries=0
        )
        self.echo_reasoning = echo_reasoning
        self.tools = [{"type": "function", "name": TOOL, "parameters": SCHEMA, "strict": False}]
        self.items: list[dict[str, Any]] = [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TASK}]}
        ]
        self.call_id = ""

    async def step(self, *, stream: bool) -> Step:
        kw = {
            "model": MODEL,
            "instructions": SYSTEM,
            "input": self.items,
            "tools": self.tools,
            "store": False,
        }
        if stream:
            async with self.client.responses.stream(**kw) as s:
                done = await s.get_final_response()
        else:
            done = await self.client.responses.create(**kw)
        reasoning, call = "", None
        for item in done.output:
            if item.type == "reasoning":
                reasoning = " ".join(c.text for c in (item.content or item.summary or []))
                if not self.echo_reasoning:
                    continue
            if item.type == "function_call":
                call, self.call_id = (item.name, json.loads(item.arguments)), item.call_id
            self.items.append(item.model_dump(exclude_none=True))
        return Step(done.output_text, reasoning, call)

    def add_result(self, output: str) -> None:
        self.items.append(
            {"type": "function_call_output", "call_id": self.call_id, "output": output}
        )


# -- Anthropic Messages (Claude Code) ----------------------------------------------------
class AnthropicAgent:
    protocol = "anthropic_messages"

    def __init__(self, proxy_url: str, token: str, *, echo_reasoning: bool = True) -> None:
        self.client = anthropic.AsyncAnthropic(
            base_url=session_url(proxy_url, token), api_key="unused", max_retries=0
        )
        self.echo_reasoning = echo_reasoning
        self.tools = [{"name": TOOL, "description": "run a command", "input_schema": SCHEMA}]
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
        self.call_id = ""

    async def step(self, *, stream: bool) -> Step:
        kw = {
            "model": MODEL,
            "max_tokens": 1024,
            "system": [{"type": "text", "text": SYSTEM}],
            "messages": self.messages,
            "tools": self.tools,
        }
        if stream:
            async with self.client.messages.stream(**kw) as s:
                done = await s.get_final_message()
        else:
            done = await self.client.messages.create(**kw)
        text, reasoning, call, echo = "", "", None, []
        for block in done.content:
            if block.type == "thinking":
                reasoning = block.thinking
                if not self.echo_reasoning:
                    continue
            elif block.type == "text":
                text += block.text
            elif block.type == "tool_use":
                call, self.call_id = (block.name, dict(block.input)), block.id
            echo.append(block.model_dump(exclude_none=True))
        self.messages.append({"role": "assistant", "content": echo})
        return Step(text, reasoning, call)

    def add_result(self, output: str) -> None:
        result = {"type": "tool_result", "tool_use_id": self.call_id, "content": output}
        self.messages.append({"role": "user", "content": [result]})


# -- Gemini generateContent (Gemini CLI) -------------------------------------------------
class GeminiAgent:
    protocol = "gemini"

    def __init__(self, proxy_url: str, token: str, *, echo_reasoning: bool = True) -> None:
        self.client = genai.Client(
            api_key="unused", http_options=gt.HttpOptions(base_url=session_url(proxy_url, token))
        )
        self.echo_reasoning = echo_reasoning
        self.config = gt.GenerateContentConfig(
            system_instruction=SYSTEM,
            tools=[
                gt.Tool(
                    function_declarations=[
                        gt.FunctionDeclaration(
                            name=TOOL, description="run a command", parameters_json_schema=SCHEMA
                        )
                    ]
                )
            ],
            automatic_function_calling=gt.AutomaticFunctionCallingConfig(disable=True),
        )
        self.contents: list[gt.Content] = [gt.Content(role="user", parts=[gt.Part(text=TASK)])]
        self.call: gt.FunctionCall | None = None

    async def step(self, *, stream: bool) -> Step:
        models = self.client.aio.models
        if stream:
            parts = []
            async for chunk in await models.generate_content_stream(
                model=MODEL, contents=self.contents, config=self.config
            ):
                if chunk.candidates and chunk.candidates[0].content:
                    parts += chunk.candidates[0].content.parts or []
        else:
            done = await models.generate_content(
                model=MODEL, contents=self.contents, config=self.config
            )
            parts = list(done.candidates[0].content.parts or [])
        parts = [p for p in parts if p.function_call or p.text]  # drop keep-alive chunks
        reasoning = "".join(p.text for p in parts if p.thought)
        if not self.echo_reasoning:
            parts = [p for p in parts if not p.thought]
        self.contents.append(gt.Content(role="model", parts=parts))
        calls = [p.function_call for p in parts if p.function_call]
        self.call = calls[0] if calls else None
        text = "".join(p.text for p in parts if p.text and not p.thought)
        call = (self.call.name, dict(self.call.args or {})) if self.call else None
        return Step(text, reasoning, call)

    def add_result(self, output: str) -> None:
        assert self.call is not None
        response = gt.FunctionResponse(
            id=self.call.id, name=self.call.name, response={"output": output}
        )
        self.contents.append(gt.Content(role="user", parts=[gt.Part(function_response=response)]))


AGENTS = (ChatAgent, ResponsesAgent, AnthropicAgent, GeminiAgent)


# -- reading what the proxy captured -----------------------------------------------------
async def captured(bus, session_id: str, *, expect: int | None = None) -> list[CompletionRecord]:
    """Every CompletionRecord of a session, in stream order (claim-checks resolved).
    ``expect``: wait up to 10 s for each of that many (a loaded machine can take seconds
    to deliver one), then 0.3 s for any more; without it, read until 2 s of silence."""
    sub = await bus.js.subscribe(S.completions(session_id), ordered_consumer=True)
    out: list[CompletionRecord] = []
    try:
        while True:
            timeout = 2.0 if expect is None else 0.3 if len(out) >= expect else 10.0
            try:
                msg = await sub.next_msg(timeout=timeout)
            except TimeoutError:
                break
            out.append(decode(await bus.payload(msg), CompletionRecord))
    finally:
        await sub.unsubscribe()
    return out
