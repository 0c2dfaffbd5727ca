"""Mistral (tekken tokenizers): ``[TOOL_CALLS]`` tool calls and Magistral's ``[THINK]``
reasoning, as mistral-common decodes them and vLLM's ``mistral`` tool and reasoning
parsers read them::

    v11+    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}
            [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}
    v2-v7   [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]
    Magistral  [THINK]reasoning[/THINK]answer

Text before the first ``[TOOL_CALLS]`` is content. A name followed directly by ``{`` (no
``[ARGS]``, what a decode that skips special tokens leaves) is read too, as vLLM does.
Where vLLM returns a v11 call whose arguments are not JSON as a call anyway, we keep it in
content as a failure, like every family here. Reasoning follows vLLM's reasoning parser:
``[THINK]`` without ``[/THINK]`` makes the rest reasoning (cut off); no ``[THINK]`` means
no reasoning, unless the prompt opened the block (``reasoning_open``).
"""

from __future__ import annotations

import json
import re
from itertools import pairwise
from typing import Any

import msgspec

from services.common.tokenization.families.base import ModelFamily
from services.common.tokenization.toolcalls import (
    ParsedReply,
    ParsedToolCall,
    ToolCallFailure,
    object_arguments_call,
    parse_json_call,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
THINK = "[THINK]"
THINK_END = "[/THINK]"
EOS = "</s>"

_SPACE = re.compile(r"\s*")
_LIST_START = re.compile(r"\[\s*[{\]]")  # v2-v7's JSON list, not [ARGS] / [CALL_ID]
_decoder = json.JSONDecoder()


def parse_mistral(
    text: str, tools: list[dict[str, Any]] | None = None, *, reasoning_open: bool = False
) -> ParsedReply:
    """Split Mistral output into reasoning, content and tool calls. Calls that do not
    parse stay in content and are listed in errors and failures."""
    reasoning, before, rest_start = _split_think(text, reasoning_open)
    rest = text[rest_start:]
    marks = [m.start() for m in re.finditer(re.escape(TOOL_CALLS), rest)]
    calls: list[ParsedToolCall] = []
    failures: list[ToolCallFailure] = []
    kept = [before, rest[: marks[0]] if marks else rest]
    for lo, hi in pairwise([*marks, len(rest)]):
        try:
            found, stop = _calls_at(rest[:hi], lo + len(TOOL_CALLS))
        except ValueError as exc:
            end = rest_start + len(rest[:hi].rstrip())
            failures.append(ToolCallFailure("malformed", str(exc), rest_start + lo, end))
            kept.append(rest[lo:hi])
            continue
        calls.extend(found)
        kept.append(rest[stop:hi])
    return ParsedReply(
        content="".join(kept).strip() if calls else before + rest,
        reasoning=reasoning,
        tool_calls=calls,
        errors=[f.detail for f in failures],
        failures=failures,
    )


def _split_think(text: str, reasoning_open: bool) -> tuple[str | None, str, int]:
    """(reasoning, the text before it, where the text after it starts)."""
    opened = text.find(THINK)
    if opened >= 0:
        before, start = text[:opened], opened + len(THINK)
    elif reasoning_open:
        before, start = "", 0
    else:
        return None, "", 0
    closed = text.find(THINK_END, start)
    if closed < 0:
        return text[start:], before, len(text)
    return text[start:closed], before, closed + len(THINK_END)


def _listed_call(item: Any) -> ParsedToolCall:
    """One ``{"name", "arguments", "id"}`` of the v2-v7 list; the id the model wrote is
    kept: its tool result must carry it back (the template checks it)."""
    call = parse_json_call(json.dumps(item))
    sampled_id = item.get("id") if isinstance(item, dict) else None
    return msgspec.structs.replace(call, id=sampled_id) if isinstance(sampled_id, str) else call


def _calls_at(text: str, pos: int) -> tuple[list[ParsedToolCall], int]:
    """The call(s) after one ``[TOOL_CALLS]`` (``text`` ends where the next one starts),
    and where they end. Raises ValueError when they do not parse."""
    pos = _SPACE.match(text, pos).end()
    if _LIST_START.match(text, pos):  # v2-v7: a JSON list of {"name", "arguments"} objects
        items, stop = _json_at(text, pos)
        if not isinstance(items, list):
            raise ValueError("[TOOL_CALLS] must be followed by a JSON list of calls")
        return [_listed_call(item) for item in items], stop
    args_mark = text.find(ARGS, pos)
    if args_mark >= 0:
        head, args_at = text[pos:args_mark], args_mark + len(ARGS)
    else:
        args_at = text.find("{", pos)
        if args_at < 0:
            raise ValueError("tool call has no [ARGS] after its name")
        head = text[pos:args_at]
    name = head.partition(CALL_ID)[0].strip()
    if not name:
        raise ValueError("tool call function name is empty")
    args, stop = _json_at(text, _SPACE.match(text, args_at).end())
    return [object_arguments_call(name, args)], stop


def _json_at(text: str, pos: int) -> tuple[Any, int]:
    try:
        return _decoder.raw_decode(text, pos)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"tool call is not valid JSON: {exc.msg} (character {exc.pos - pos})"
        ) from exc


FAMILY = ModelFamily(
    late_system_as_user=True,
    tool_call_id_length=9,  # the template refuses other ids (vLLM cuts them to 9 too)
    name="mistral",
    parse=parse_mistral,
    turn_ends=(EOS,),
    notes="Mistral (tekken): [TOOL_CALLS]name[ARGS]{json} or a JSON list, [THINK] reasoning",
)
