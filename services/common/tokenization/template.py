"""Chat-template rendering with Hugging Face conventions, in a Jinja sandbox.

Renders the ``chat_template`` of a model directory exactly as ``transformers``'
``apply_chat_template(..., tokenize=False)`` would for text-only conversations: the same
sandbox (immutable, ``trim_blocks``/``lstrip_blocks``, loop controls), the same ``tojson``
filter (``ensure_ascii=False``), ``raise_exception`` and ``strftime_now`` globals, and the
``bos_token``/``eos_token`` variables. ``{% generation %}`` blocks render their body.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from functools import lru_cache
from importlib import resources
from typing import Any

import orjson
from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.tokenization.lru import SizedLRU


class TemplateRenderError(ValueError):
    """The chat template rejected the conversation (bad role, bad content, template bug)."""


def default_template() -> str:
    """Polar's own ChatML template with Qwen/Hermes tool calls (see polar_chatml.jinja)."""
    return resources.files(__package__).joinpath("polar_chatml.jinja").read_text("utf-8")


class _GenerationBlock(Extension):
    # HF's {% generation %} marks assistant tokens for masks; for text it is transparent.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """HF's ``tojson`` (stdlib ``json.dumps``), memoised: a CLI's tool schemas and its
    past calls' arguments are dumped again at every render of every call, and stdlib
    json was a third of a long conversation's render time."""
    try:
        compact = orjson.dumps(value)
    except TypeError:  # e.g. non-string keys: not worth remembering
        compact = b""
    key = (compact, ensure_ascii, indent, separators, sort_keys)
    # orjson writes inf as null, so a value holding one must not share None's entry
    remember = len(compact) >= MEMO_MIN_BYTES and not (b"null" in compact and _has_nonfinite(value))
    if remember and (hit := _dumped.get(key)) is not None:
        return hit
    out = json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    if remember:
        _dumped.put(key, out)
    return out


def _has_nonfinite(value) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_nonfinite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_nonfinite(v) for v in value)
    return False


MEMO_MIN_BYTES = 64  # smaller values dump faster than they hash
_dumped: SizedLRU[tuple, str] = SizedLRU(16_000_000, lambda key, text: len(key[0]) + len(text))


def _raise_exception(message):
    raise TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_template(
    source: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str | None] | None = None,
    **template_kwargs: Any,
) -> str:
    """Render ``messages`` (OpenAI chat dicts) and ``tools`` with the Jinja ``source``.

    ``special_tokens`` supplies ``bos_token``/``eos_token`` etc.; extra keyword arguments
    are passed to the template like HF's ``chat_template_kwargs`` (e.g. ``enable_thinking``).
    Raises TemplateRenderError when the template raises or fails.
    """
    variables = dict(special_tokens or {})
    variables.update(template_kwargs)
    try:
        return _compile(source).render(
            messages=messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except TemplateError as exc:
        raise TemplateRenderError(str(exc)) from exc
    except (TypeError, AttributeError, KeyError) as exc:
        raise TemplateRenderError(f"chat template failed: {exc}") from exc
