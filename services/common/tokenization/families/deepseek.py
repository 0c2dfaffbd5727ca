"""DeepSeek V3 / V3.1+: tool calls between DeepSeek's full-width special tokens, as vLLM's
``deepseek_v31`` / ``deepseek_v3`` and SGLang's ``deepseekv31`` / ``deepseekv3`` parsers
read them::

    V3.1  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    V3    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{"a": 1}\\n```<｜tool▁call▁end｜>...

Reasoning is what precedes ``</think>``. V3.1's thinking mode ends the generation prompt
with ``<think>`` (R1-style templates with ``<think>\\n``), so the output opens inside the
reasoning block (``reasoning_open``); thinking off ends it with ``</think>``.

Text before the calls is content (vLLM keeps it as written, SGLang strips it; we strip it
when there are calls, as ``toolcalls.parse_reply`` does). Text after
``<｜tool▁calls▁end｜>``, which both engines drop, stays content here: nothing the model
wrote is lost. A section that opens with a bare ``<｜tool▁call▁begin｜>`` is read too.
"""

from __future__ import annotations

import re
from typing import Any

from services.common.tokenization.families.base import ModelFamily
from services.common.tokenization.toolcalls import (
    ParsedReply,
    ParsedToolCall,
    ToolCallFailure,
    json_arguments_call,
    split_reasoning,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
END_OF_SENTENCE = "<｜end▁of▁sentence｜>"

# one call: up to its end token, or (cut off) the next call, the section's end, the text's
_BEGIN, _END, _SEP, _LAST = map(re.escape, (CALL_BEGIN, CALL_END, SEP, CALLS_END))
_CALL = re.compile(rf"{_BEGIN}(.*?)(?:{_END}|(?={_BEGIN})|(?={_LAST})|\Z)", re.DOTALL)
# V3's body: the call type, then the name and a fenced JSON block
_V3_BODY = re.compile(rf"\s*\w+{_SEP}([^\n]*)\n```(?:json)?\n(.*?)\n?```\s*\Z", re.DOTALL)


def parse_deepseek(
    text: str, tools: list[dict[str, Any]] | None = None, *, reasoning_open: bool = False
) -> ParsedReply:
    """Split DeepSeek V3 / V3.1 output into reasoning, content and tool calls. Calls that
    do not parse stay in content and are listed in errors and failures."""
    reasoning, rest = split_reasoning(text, reasoning_open)
    offset = len(text) - len(rest)  # where ``rest`` starts in ``text``
    begin = _section_start(rest)
    if begin < 0:
        return ParsedReply(content=rest, reasoning=reasoning, tool_calls=[], errors=[], failures=[])
    section_end = rest.find(CALLS_END, begin)
    if section_end < 0:
        section_end = len(rest)
    calls: list[ParsedToolCall] = []
    failures: list[ToolCallFailure] = []
    kept = [rest[:begin]]
    cursor = begin + len(CALLS_BEGIN) if rest.startswith(CALLS_BEGIN, begin) else begin
    for match in _CALL.finditer(rest, cursor, section_end):
        kept.append(rest[cursor : match.start()])
        cursor = match.end()
        try:
            if not match.group(0).endswith(CALL_END):
                raise ValueError("unterminated tool call (no <｜tool▁call▁end｜>)")
            calls.append(_call(match.group(1)))
        except ValueError as exc:
            failures.append(
                ToolCallFailure("malformed", str(exc), offset + match.start(), offset + match.end())
            )
            kept.append(match.group(0))
    kept.append(rest[cursor:section_end])
    kept.append(rest[section_end + len(CALLS_END) :])
    return ParsedReply(
        content="".join(kept).strip() if calls else rest,
        reasoning=reasoning,
        tool_calls=calls,
        errors=[f.detail for f in failures],
        failures=failures,
    )


def _section_start(text: str) -> int:
    found = [i for i in (text.find(CALLS_BEGIN), text.find(CALL_BEGIN)) if i >= 0]
    return min(found, default=-1)


def _call(body: str) -> ParsedToolCall:
    """One call's body, V3 (fenced JSON) or V3.1 (bare JSON). Raises ValueError."""
    v3 = _V3_BODY.match(body)
    if v3:
        name, raw = v3.group(1), v3.group(2)
    else:
        name, sep, raw = body.partition(SEP)
        if not sep:
            raise ValueError("tool call has no <｜tool▁sep｜> after its name")
    name = name.strip()
    if not name:
        raise ValueError("tool call function name is empty")
    return json_arguments_call(name, raw)


FAMILY = ModelFamily(
    late_system_as_user=True,
    name="deepseek_v3",
    parse=parse_deepseek,
    # the official templates join the arguments text into the prompt as it is
    # ('<｜tool▁sep｜>' + arguments): a mapping would make them fail
    arguments_as_mapping=False,
    turn_ends=(END_OF_SENTENCE,),
    thinking_kwarg="thinking",
    # V3.1 thinking on: "<｜Assistant｜><think>"; R1-style templates add a newline
    reasoning_open_suffixes=("<think>", "<think>\n"),
    notes="DeepSeek V3 / V3.1+: <｜tool▁call▁begin｜> calls, </think> reasoning, thinking",
)
