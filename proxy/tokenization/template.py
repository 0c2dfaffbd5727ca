"""Chat-template rendering with Hugging Face conventions, in a Jinja sandbox.

Renders the ``chat_template`` of a model directory exactly as ``transformers``'
``apply_chat_template(..., tokenize=False)`` would for text-only conversations: the same
sandbox (immutable, ``trim_blocks``/``lstrip_blocks``, loop controls), the same ``tojson``
filter (``ensure_ascii=False``), ``raise_exception`` and ``strftime_now`` globals, and the
``bos_token``/``eos_token`` variables. ``{% generation %}`` blocks render their body.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from datetime import datetime
from functools import lru_cache
from importlib import resources
from typing import Any

import orjson
from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


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
        key = (orjson.dumps(value), ensure_ascii, indent, separators, sort_keys)
    except TypeError:  # e.g. non-string keys: not worth remembering
        key = None
    if key is not None and len(key[0]) >= MEMO_MIN_BYTES:
        hit = _dumped.get(key)
        if hit is not None:
            _dumped.move_to_end(key)
            return hit
    out = json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    if key is not None and len(key[0]) >= MEMO_MIN_BYTES:
        global _dumped_chars
        _dumped[key] = out
        _dumped_chars += len(out) + len(key[0])
        while _dumped_chars > MEMO_MAX_CHARS and _dumped:
            (old, _, _, _, _), text = _dumped.popitem(last=False)
            _dumped_chars -= len(text) + len(old)
    return out


MEMO_MIN_BYTES = 64  # smaller values dump faster than they hash
MEMO_MAX_CHARS = 16_000_000
_dumped: OrderedDict[tuple, str] = OrderedDict()
_dumped_chars = 0


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
