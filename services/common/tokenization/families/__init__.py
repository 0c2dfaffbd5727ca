"""Model families: each one's template conventions and output parser (``base.ModelFamily``).

A model directory's family is found from its ``config.json`` and its chat template
(``detect_family``), or named in the topology (``model_family``). A model no family
matches keeps its own template and the generic ``<think>`` / ``<tool_call>`` parsing, with
a warning naming what is not known. Adding a family: a module here with a parser and a
``ModelFamily``, a line in ``_DETECT``, and a fixture in ``tests/helpers/model_families.py``
(docs/models.md).
"""

from __future__ import annotations

import logging
from typing import Any

from services.common.tokenization.families.base import (
    ModelFamily,
    check_calls,
    schema_problem,
)
from services.common.tokenization.families.deepseek import FAMILY as DEEPSEEK_V3
from services.common.tokenization.families.harmony import FAMILY as GPT_OSS
from services.common.tokenization.families.llama import FAMILY as LLAMA3
from services.common.tokenization.families.mistral import FAMILY as MISTRAL
from services.common.tokenization.families.qwen import GENERIC, POLAR_CHATML, QWEN3, QWEN3_5

log = logging.getLogger("polar.tokenization")

FAMILIES: dict[str, ModelFamily] = {
    f.name: f
    for f in (QWEN3, QWEN3_5, LLAMA3, GPT_OSS, DEEPSEEK_V3, MISTRAL, POLAR_CHATML, GENERIC)
}

# model_type values of config.json that name a family outright
_MODEL_TYPES = {
    "gpt_oss": GPT_OSS,
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v32": DEEPSEEK_V3,
    "mistral": MISTRAL,
    "mistral3": MISTRAL,
    "ministral": MISTRAL,
}

# Otherwise the template's own markup says it, most specific first (a Qwen3.5 template
# has <tool_call> and <|im_start|> too, its XML parameters set it apart).
_DETECT: tuple[tuple[ModelFamily, tuple[str, ...]], ...] = (
    (GPT_OSS, ("<|channel|>",)),
    (QWEN3_5, ("<function=", "<parameter=")),
    (QWEN3, ("<tool_call>", "<|im_start|>")),
    (LLAMA3, ("<|start_header_id|>",)),
    (DEEPSEEK_V3, ("<｜Assistant｜>",)),
    (MISTRAL, ("[INST]",)),
)


class UnknownFamilyError(ValueError):
    """A topology named a family Polar does not have."""


def family_named(name: str) -> ModelFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise UnknownFamilyError(f"unknown model_family {name!r}; known: {known}") from None


def detect_family(
    template: str, config: dict[str, Any] | None = None, *, polar_template: bool = False
) -> ModelFamily:
    """The family of a model with this chat template and ``config.json``."""
    if polar_template:
        return POLAR_CHATML
    model_type = str((config or {}).get("model_type") or "")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    for family, marks in _DETECT:
        if all(mark in template for mark in marks):
            return family
    return GENERIC


def family_for(
    template: str,
    config: dict[str, Any] | None = None,
    *,
    override: str | None = None,
    polar_template: bool = False,
    where: str = "",
) -> ModelFamily:
    """``override`` (a topology's ``model_family``) if given, else detected; a model no
    family matches is logged once, naming what is not known."""
    if override:
        return family_named(override)
    family = detect_family(template, config, polar_template=polar_template)
    if not family.known:
        model_type = (config or {}).get("model_type") or "no model_type"
        log.warning(
            "%s: no model family matches this model (%s); token mode renders its own "
            "chat template and reads <think> / <tool_call> output only; name one with "
            "model_family (%s) if it is one of them",
            where or "model",
            model_type,
            ", ".join(n for n, f in FAMILIES.items() if f.known),
        )
    return family


__all__ = [
    "FAMILIES",
    "ModelFamily",
    "UnknownFamilyError",
    "check_calls",
    "detect_family",
    "family_for",
    "family_named",
    "schema_problem",
]
