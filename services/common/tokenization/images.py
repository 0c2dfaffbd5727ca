"""Images in prompts: where their tokens sit, what they are, and how they are named.

A vision model's chat template writes one placeholder per image
(``<|vision_start|><|image_pad|><|vision_end|>``); the model reads ``tokens_per_image``
embeddings per image, so each ``<|image_pad|>`` is expanded to that many pad ids in the
prompt (``ImageTokens.expand``). The engine puts an image's patch embeddings at its pad
positions, in prompt order. Everything else refers to an image by its digest (the
sha256 of its bytes as sent): records and trajectories store digests and token spans,
never the bytes.

Pure functions: the proxy (token mode), the embedded engine and the trainer share them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD)
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
# what the template sets for a vision model (prepended to Polar's ChatML template)
VISION_TEMPLATE_PRELUDE = "{%- set image_placeholder = '" + IMAGE_PLACEHOLDER + "' -%}\n"
# OpenAI-shaped content parts that carry an image (the proxy's conversation writes
# ``image_url``; the others are what other clients of the template send)
IMAGE_PART_TYPES = ("image_url", "image", "input_image")


class ImageInputError(ValueError):
    """An image the model cannot be given (not inline data, bad base64, wrong count)."""


@dataclass(frozen=True)
class ImageTokens:
    """How a vision model's prompts hold images: the pad id and how many per image."""

    pad_id: int
    per_image: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ImageTokens | None:
        """From a model's ``config.json`` mapping; None for a text-only model, and for a
        vision model whose image token count depends on each image (Qwen-VL's dynamic
        resolution: only its engine's processor can expand those, so only chat mode
        serves its images)."""
        vision = config.get("vision_config")
        if not vision or "tokens_per_image" not in vision:
            return None
        return cls(int(vision["image_token_id"]), int(vision["tokens_per_image"]))

    def expand(self, ids: list[int]) -> list[int]:
        """Each single pad id (one image, as the template wrote it) -> ``per_image`` pads.
        Runs already expanded (a previous prompt reused as is) are never in ``ids``: the
        tokenizer sees template text, which holds one pad per image."""
        if self.pad_id not in ids:
            return ids
        out: list[int] = []
        for token in ids:
            if token == self.pad_id:
                out.extend([self.pad_id] * self.per_image)
            else:
                out.append(token)
        return out

    def spans(self, ids: list[int]) -> list[tuple[int, int]]:
        """(start, length) of each run of pad ids, in order. Raises ImageInputError for a
        run that is not exactly one image long (a truncated or merged placeholder)."""
        out: list[tuple[int, int]] = []
        i, n = 0, len(ids)
        while i < n:
            if ids[i] != self.pad_id:
                i += 1
                continue
            start = i
            while i < n and ids[i] == self.pad_id:
                i += 1
            if (i - start) % self.per_image:
                raise ImageInputError(
                    f"image tokens at {start}..{i} are not a whole number of images "
                    f"({self.per_image} tokens each)"
                )
            out += [(s, self.per_image) for s in range(start, i, self.per_image)]
        return out


def image_digest(data: bytes) -> str:
    """The name of an image everywhere after the proxy: ``sha256:<hex>`` of its bytes."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def decode_image_url(url: str) -> tuple[str, bytes]:
    """(media type, bytes) of a ``data:<type>;base64,<data>`` URL. Remote URLs are refused:
    nothing here fetches from the network, and a record must name exactly what the model
    saw."""
    if not url.startswith("data:"):
        shown = url if len(url) <= 80 else url[:77] + "..."
        raise ImageInputError(
            f"image {shown!r} is not inline data: send the image's bytes (a data: URL or "
            "base64 source), remote image URLs are not fetched"
        )
    head, sep, payload = url[5:].partition(",")
    if not sep or not head.endswith(";base64"):
        raise ImageInputError("image data URL must be base64 encoded (data:<type>;base64,...)")
    # the URL-safe alphabet too: Gemini's clients send it (its API takes both)
    altchars = b"-_" if "-" in payload or "_" in payload else None
    try:
        data = base64.b64decode(payload, altchars=altchars, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageInputError(f"image data is not valid base64: {exc}") from exc
    if not data:
        raise ImageInputError("image data is empty")
    return head[: -len(";base64")] or "application/octet-stream", data


def image_urls(messages: Iterable[dict[str, Any]]) -> list[str]:
    """The image URLs of OpenAI-shaped messages in the order the template renders them
    (message by message, part by part)."""
    out: list[str] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                out.append(part_url(part))
    return out


def part_url(part: dict[str, Any]) -> str:
    """The URL of an image part (``image_url: {url}`` or ``image_url: "..."``)."""
    value = part.get("image_url", part.get("url", ""))
    if isinstance(value, dict):
        value = value.get("url", "")
    return str(value)
