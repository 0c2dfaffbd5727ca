"""ChatML families: Qwen3 (Hermes JSON tool calls), Qwen3.5 / Qwen3.6 (qwen3_coder XML tool
calls), Polar's own template, and the generic fallback for a model no family matches.

All read ``<think>`` reasoning and ``<tool_call>`` blocks (either encoding) with
``toolcalls.parse_reply``, as vLLM's ``hermes`` / ``qwen3_coder`` tool parsers and its
``qwen3`` reasoning parser do.
"""

from __future__ import annotations

from services.common.tokenization.families.base import ModelFamily
from services.common.tokenization.toolcalls import parse_reply

IM_END = "<|im_end|>"

QWEN3 = ModelFamily(
    name="qwen3",
    parse=parse_reply,
    turn_ends=(IM_END,),
    thinking_kwarg="enable_thinking",
    reasoning_open_suffixes=("<think>\n",),
    notes="Qwen3: Hermes JSON tool calls in <tool_call>, <think> reasoning, enable_thinking",
)

QWEN3_5 = ModelFamily(
    late_system_as_user=True,
    name="qwen3_5",
    parse=parse_reply,
    turn_ends=(IM_END,),
    thinking_kwarg="enable_thinking",
    # thinking on: the generation prompt ends with "<think>\n", the output inside it
    reasoning_open_suffixes=("<think>\n",),
    notes="Qwen3.5 / Qwen3.6: XML tool calls (<function=...><parameter=...>), thinking",
)

POLAR_CHATML = ModelFamily(
    name="polar_chatml",
    parse=parse_reply,
    arguments_as_mapping=False,  # the template writes argument text as the model wrote it
    turn_ends=(IM_END,),
    notes="Polar's own append-only ChatML template (toy and demo models)",
)

GENERIC = ModelFamily(
    name="generic",
    parse=parse_reply,
    known=False,
    notes="a model no family matched: its own template, <think> and <tool_call> parsing",
)
