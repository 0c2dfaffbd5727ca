"""gpt-oss: OpenAI's harmony format, read as vLLM's ``openai`` tool parser and its harmony
reasoning parser read it.

The generation prompt ends with ``<|start|>assistant``; the model then writes messages::

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

(the closing ``<|call|>`` / ``<|return|>`` is not in the text: it ended the turn). The
recipient may sit in the header before the channel, as the template renders history:
``<|start|>assistant to=functions.x<|channel|>commentary json<|message|>...``.

* reasoning: the ``analysis`` messages, joined by newlines;
* content: the ``final`` messages and the ``commentary`` messages without a recipient
  (preambles, shown to the user), joined by newlines, as vLLM's ``parse_chat_output``;
* tool calls: messages with a recipient, ``functions.NAME`` -> ``NAME``. A recipient
  outside ``functions`` (a built-in ``browser.*`` / ``python`` the request did not
  configure) is kept as a call of that name, so the family checks report it as an unknown
  tool rather than dropping it as vLLM's chat endpoint does.

Output cut off mid-message is read as far as it goes: partial analysis is reasoning,
partial final text is content, a call whose JSON did not finish is a failure.
"""

from __future__ import annotations

import re
from itertools import pairwise
from typing import Any, NamedTuple

from services.common.tokenization.families.base import ModelFamily
from services.common.tokenization.toolcalls import (
    ParsedReply,
    ParsedToolCall,
    ToolCallFailure,
    json_arguments_call,
)

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
FUNCTIONS = "functions."

_MESSAGE_END = re.compile(r"<\|(?:end|call|return)\|>")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_ROLE = re.compile(r"[^\s<]*")


class _Message(NamedTuple):
    role: str  # "" for the first message: the prompt wrote its role
    header: str  # between the role and <|message|>
    body: str | None  # None: the text ends inside the header
    start: int  # where the message's markup starts in the text (its <|start|>, if any)
    end: int  # past its closing token, or the text's end
    trailing: str  # text after the closing token, before the next <|start|> (stray)


def parse_harmony(
    text: str, tools: list[dict[str, Any]] | None = None, *, reasoning_open: bool = False
) -> ParsedReply:
    """Split gpt-oss output (the text after the prompt's ``<|start|>assistant``) into
    reasoning, content and tool calls. ``reasoning_open`` is ignored: every message names
    its channel. Calls that do not parse stay in content (their markup) and are listed in
    errors and failures."""
    thinking: list[str] = []
    shown: list[str] = []
    calls: list[ParsedToolCall] = []
    failures: list[ToolCallFailure] = []
    for message in _messages(text):
        if message.role not in ("", "assistant"):  # e.g. a tool's reply the model made up
            shown.append(text[message.start : message.end] + message.trailing)
            continue
        recipient = _RECIPIENT.search(message.header)
        channel = _CHANNEL.search(message.header)
        if recipient:
            try:
                calls.append(_call(recipient.group(1), message.body))
            except ValueError as exc:
                failures.append(ToolCallFailure("malformed", str(exc), message.start, message.end))
                shown.append(text[message.start : message.end])
        elif message.body is None:
            if CHANNEL not in message.header and message.header.strip():
                shown.append(message.header)  # text with no harmony markup at all
        elif channel and channel.group(1) == "analysis":
            thinking.append(message.body)
        else:  # final, a preamble, or a message that named no channel
            shown.append(message.body)
        if message.trailing.strip():
            shown.append(message.trailing)
    return ParsedReply(
        content="\n".join(shown),
        reasoning="\n".join(thinking) if thinking else None,
        tool_calls=calls,
        errors=[f.detail for f in failures],
        failures=failures,
    )


def _messages(text: str) -> list[_Message]:
    """The messages of ``text``, split at each ``<|start|>``; the first has no start (the
    prompt wrote it) and so no role."""
    starts = [0] + [m.start() for m in re.finditer(re.escape(START), text)]
    return [_message(text, lo, hi) for lo, hi in pairwise([*starts, len(text)]) if hi > lo]


def _message(text: str, lo: int, hi: int) -> _Message:
    header_start, role = lo, ""
    if text.startswith(START, lo):
        role_match = _ROLE.match(text, lo + len(START))
        header_start, role = role_match.end(), role_match.group()
    opened = text.find(MESSAGE, header_start, hi)
    if opened < 0:
        return _Message(role, text[header_start:hi], None, lo, hi, "")
    body_start = opened + len(MESSAGE)
    closed = _MESSAGE_END.search(text, body_start, hi)
    body_end = closed.start() if closed else hi
    end = closed.end() if closed else hi
    header, body = text[header_start:opened], text[body_start:body_end]
    return _Message(role, header, body, lo, end, text[end:hi])


def _call(recipient: str, body: str | None) -> ParsedToolCall:
    """A message to ``recipient`` as a tool call. Raises ValueError when it is cut off or
    its arguments are not a JSON object."""
    name = recipient.removeprefix(FUNCTIONS)
    if not name:
        raise ValueError("tool call recipient has no function name")
    if body is None:
        raise ValueError(f"tool call to {recipient} ends before its arguments")
    return json_arguments_call(name, body)


FAMILY = ModelFamily(
    tool_description_required=True,
    late_system_as_user=True,
    name="gpt_oss",
    parse=parse_harmony,
    reasoning_key="thinking",  # the template reads message.thinking
    turn_ends=(END, CALL, RETURN),
    effort_kwarg="reasoning_effort",
    notes="gpt-oss (harmony): analysis/commentary/final channels, to=functions.NAME calls",
)
