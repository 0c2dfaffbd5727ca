"""Scripted policy: replies follow a YAML script, emitted as real tokens with real logprobs.

```yaml
turns:
  - match: "(?i)weather"          # optional: regex searched in the last message
    text: "Let me check."
    tool_calls: [{name: get_weather, arguments: {city: Paris}}]
  - reasoning: "The tool answered."  # optional <think> block
    text: "It is sunny."
after_last: repeat                 # or: cycle
default: {text: "I have nothing scripted for that."}
```

Choice, per request: the first turn whose ``match`` regex is found in the last message
wins; otherwise the turns without ``match`` are taken in order, indexed by the number of
assistant turns already in the conversation (past the end: repeat the last, or cycle);
with no such turns, ``default``. The reply is rendered by the model's own chat template as
an assistant turn and tokenized by its tokenizer; the engine then emits those ids through
the normal sampling path (forced choice), reporting the model's logprob of each.

The server shows the script the conversation as the model sees it, read back from the
prompt tokens, so chat mode and token mode choose alike (tool results then read as
``<tool_response>`` blocks in a user turn).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml
from msgspec import Struct

from services.common.tokenization import ChatTokenizer


class PolicyError(ValueError):
    """The script file is unreadable or invalid (a startup configuration error)."""


class ScriptedCall(Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    arguments: dict[str, Any] = {}


class ScriptedTurn(Struct, frozen=True, forbid_unknown_fields=True):
    match: str | None = None
    text: str = ""
    reasoning: str | None = None
    tool_calls: list[ScriptedCall] = []


class Policy(Struct, frozen=True, forbid_unknown_fields=True):
    turns: list[ScriptedTurn] = []
    after_last: Literal["repeat", "cycle"] = "repeat"
    default: ScriptedTurn = ScriptedTurn()


def load_policy(path: str | Path) -> Policy:
    try:
        raw = yaml.safe_load(Path(path).read_text("utf-8")) or {}
        policy = msgspec.convert(raw, Policy)
    except (OSError, yaml.YAMLError, msgspec.ValidationError) as exc:
        raise PolicyError(f"scripted policy {path}: {exc}") from exc
    for turn in policy.turns:
        if turn.match is not None:
            try:
                re.compile(turn.match)
            except re.error as exc:
                raise PolicyError(
                    f"scripted policy {path}: bad regex {turn.match!r}: {exc}"
                ) from exc
    return policy


def message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def choose_turn(policy: Policy, messages: list[dict[str, Any]]) -> ScriptedTurn:
    last = message_text(messages[-1]) if messages else ""
    for turn in policy.turns:
        if turn.match is not None and re.search(turn.match, last):
            return turn
    positional = [t for t in policy.turns if t.match is None]
    if not positional:
        return policy.default
    index = sum(1 for m in messages if m.get("role") == "assistant")
    if index >= len(positional):
        index = index % len(positional) if policy.after_last == "cycle" else len(positional) - 1
    return positional[index]


def turn_message(turn: ScriptedTurn) -> dict[str, Any]:
    """The scripted turn as an OpenAI assistant message."""
    calls = [
        {
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in turn.tool_calls
    ]
    return {"content": turn.text, "reasoning_content": turn.reasoning, "tool_calls": calls or None}


def messages_from_prompt(prompt_text: str) -> list[dict[str, Any]]:
    """Best-effort messages of a ChatML prompt (for token-mode requests): one per
    ``<|im_start|>role`` block, without the trailing generation prompt."""
    messages = []
    for block in prompt_text.split("<|im_start|>")[1:]:
        role, _, body = block.partition("\n")
        messages.append({"role": role.strip(), "content": body.split("<|im_end|>")[0]})
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    return messages


def scripted_ids(
    policy: Policy, tokenizer: ChatTokenizer, messages: list[dict[str, Any]]
) -> list[int]:
    """The token ids the model must emit for this conversation's scripted reply."""
    reply = turn_message(choose_turn(policy, messages))
    return tokenizer.encode(tokenizer.assistant_reply_text(reply))
