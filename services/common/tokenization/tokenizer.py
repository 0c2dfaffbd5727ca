"""A model directory's tokenizer and chat template, loaded without ``transformers``.

``ChatTokenizer.load(model_dir)`` reads ``tokenizer.json`` (``tokenizers`` library),
``tokenizer_config.json`` (chat template, special tokens) and, when present,
``generation_config.json`` / ``config.json`` (end-of-sequence ids; a vision model's
``vision_config``). It renders conversations, encodes and decodes text (a vision model's
image placeholders expanded to its image tokens: ``images.py``), and knows which ids end
an assistant turn.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import msgspec
from tokenizers import Tokenizer

from services.common.tokenization.bounds import TokenFloor, token_floor
from services.common.tokenization.families import ModelFamily, check_calls, family_for
from services.common.tokenization.images import ImageTokens
from services.common.tokenization.segments import SegmentEncoder, encode_plain
from services.common.tokenization.template import (
    TemplateRenderError,
    default_template,
    render_template,
)
from services.common.tokenization.toolcalls import ParsedReply, ToolCallFailure


class TokenizerLoadError(ValueError):
    """The directory has no usable tokenizer (missing or malformed files)."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text("utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerLoadError(f"{path} is not valid JSON: {exc}") from exc


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as strings or AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _context_tokens(config: dict[str, Any]) -> int | None:
    """The context the model's ``config.json`` gives it (a vision model's in its
    ``text_config``), scaled by its ``rope_scaling`` factor as engines scale it."""
    text = config.get("text_config") or {}
    n = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    if not isinstance(n, int) or n <= 0:
        return None
    rope = config.get("rope_scaling") or text.get("rope_scaling") or {}
    factor = rope.get("factor") if isinstance(rope, dict) else None
    return int(n * factor) if isinstance(factor, int | float) and factor > 1 else n


def _chat_template_of(config: dict[str, Any], model_dir: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = model_dir / "chat_template.jinja"
    if template is None and jinja_file.exists():
        template = jinja_file.read_text("utf-8")
    return template


class ChatTokenizer:
    """Tokenizer + chat template of one model. Immutable after load; thread-safe to share."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str,
        special_tokens: dict[str, str | None],
        eos_token_ids: list[int],
        images: ImageTokens | None = None,
        family: ModelFamily | None = None,
        context_tokens: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.eos_token_ids = eos_token_ids
        self.images = images  # None: a text-only model
        self.context_tokens = context_tokens  # the model's own context (config.json), if said
        self.segments = SegmentEncoder.for_tokenizer(tokenizer)  # None: encode whole texts
        # how the family's template wants messages, and how its output reads
        self.family = family or family_for(
            chat_template, polar_template=chat_template == default_template()
        )
        # texts that end an assistant turn in a rendered history (proxy.tito's glue)
        self.turn_ends = self.family.turn_ends or tuple(
            t for t in (tokenizer.id_to_token(i) for i in eos_token_ids) if t
        )

    @classmethod
    def load(cls, model_dir: str | Path, family: str | None = None) -> ChatTokenizer:
        """Load from a Hugging Face model directory; ``family`` names the model family
        (else it is detected from the directory). Raises TokenizerLoadError."""
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.exists():
            raise TokenizerLoadError(f"{model_dir} has no tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust side raises plain Exception
            raise TokenizerLoadError(f"cannot load {tok_file}: {exc}") from exc
        config = _read_json(model_dir / "tokenizer_config.json")
        special = {
            key: _token_text(config.get(key))
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        template = _chat_template_of(config, model_dir) or default_template()
        eos_ids = cls._eos_ids(tokenizer, special, model_dir)
        model_config = _read_json(model_dir / "config.json")
        try:
            images = ImageTokens.from_config(model_config)
        except (KeyError, TypeError, ValueError) as exc:
            raise TokenizerLoadError(f"{model_dir}/config.json: bad vision_config: {exc}") from exc
        try:
            model_family = family_for(
                template,
                model_config,
                override=family,
                polar_template=template == default_template(),
                where=str(model_dir),
            )
        except ValueError as exc:
            raise TokenizerLoadError(str(exc)) from exc
        context = _context_tokens(model_config)
        return cls(tokenizer, template, special, eos_ids, images, model_family, context)

    @staticmethod
    def _eos_ids(
        tokenizer: Tokenizer, special: dict[str, str | None], model_dir: Path
    ) -> list[int]:
        ids = _as_id_list(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
        ids += _as_id_list(_read_json(model_dir / "config.json").get("eos_token_id"))
        for text in (special.get("eos_token"), "<|im_end|>"):
            token_id = tokenizer.token_to_id(text) if text else None
            if token_id is not None:
                ids.append(token_id)
        return sorted(set(ids))

    @cached_property
    def token_floor(self) -> TokenFloor | None:
        """The fewest tokens a text can take, known without tokenizing it (``bounds.py``;
        None for a tokenizer that may drop text). Measured over the vocabulary once
        (~0.2 s for 250k entries)."""
        return token_floor(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for an OpenAI-shaped conversation (as the family's template reads
        it: ``ModelFamily.prepare``). Raises TemplateRenderError."""
        return render_template(
            self.chat_template,
            self.family.prepare(messages),
            self.family.prepare_tools(tools),
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token text (e.g. ``<|im_start|>``) maps to its id,
        and a vision model's image pad to its ``per_image`` pads."""
        ids = (
            self.segments.encode(text)
            if self.segments is not None
            else encode_plain(self.tokenizer, text)
        )
        return ids if self.images is None else self.images.expand(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token as it would decode on its own (may be a partial character)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        return self.encode(self.render(messages, tools, add_generation_prompt, **template_kwargs))

    def assistant_reply_text(self, message: dict[str, Any]) -> str:
        """The text an assistant turn contributes after the generation prompt, up to and
        including its end-of-turn token: what a model must generate to produce ``message``.

        Derived from the template itself (render with and without the turn), so it holds
        for any append-only template. Raises TemplateRenderError otherwise.
        """
        probe = [{"role": "user", "content": "?"}]
        prefix = self.render(probe, add_generation_prompt=True)
        full = self.render([*probe, {"role": "assistant", **message}], add_generation_prompt=False)
        if not full.startswith(prefix):
            raise TemplateRenderError("chat template is not append-only for assistant turns")
        body = full[len(prefix) :]
        # the turn's own end is the last end-of-turn text (the content may quote one)
        ends = [self.tokenizer.id_to_token(end_id) for end_id in self.eos_token_ids]
        found = [(body.rindex(t) + len(t)) for t in ends if t and t in body]
        return body[: max(found)] if found else body

    def is_end_of_turn(self, token_id: int) -> bool:
        return token_id in self.eos_token_ids

    def parse_reply(
        self,
        output_ids: list[int],
        tools: list[dict[str, Any]] | None = None,
        prompt_ids: list[int] | None = None,
    ) -> ParsedReply:
        """Reasoning, content and tool calls of generated ids, read by the family's parser
        (the closing end-of-turn ids ignored; any other special token the model wrote is
        text, as it sampled it). ``prompt_ids``: the prompt they continue, which may have
        opened a reasoning block. Failures' ``start``/``end`` are token offsets into
        ``output_ids`` (-1: a whole-call problem, e.g. an unknown tool)."""
        ids = list(output_ids)
        while ids and self.is_end_of_turn(ids[-1]):
            ids.pop()
        text = self.decode(ids, skip_special_tokens=False)
        reasoning_open = (
            bool(prompt_ids)
            and bool(self.family.reasoning_open_suffixes)  # no decode for a family without
            and self.family.reasoning_open(
                self.decode(prompt_ids[-PROMPT_TAIL_IDS:], skip_special_tokens=False)
            )
        )
        parsed = check_calls(self.family.parse(text, tools, reasoning_open=reasoning_open), tools)
        if not parsed.failures:
            return parsed
        spans = [self._token_span(ids, f) for f in parsed.failures]
        return msgspec.structs.replace(parsed, failures=spans)

    def _token_span(self, ids: list[int], failure: ToolCallFailure) -> ToolCallFailure:
        if failure.start < 0:
            return failure
        start = self._token_at(ids, failure.start)
        end = max(start, self._token_at(ids, failure.end, after=True))
        return msgspec.structs.replace(failure, start=start, end=end)

    def _token_at(self, ids: list[int], offset: int, after: bool = False) -> int:
        """The first token whose text reaches past ``offset`` characters of the decoded
        ids (``after``: the first that ends at or past it, plus one). Binary search over
        prefix decodes: a byte-level token may be part of a character."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(ids[: mid + 1], skip_special_tokens=False)) > offset - after:
                hi = mid
            else:
                lo = mid + 1
        return lo + 1 if after else lo


# a generation prompt's last few ids are enough to see whether it opened a reasoning block
PROMPT_TAIL_IDS = 4
