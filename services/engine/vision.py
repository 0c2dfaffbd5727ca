"""The embedded engine's image encoder: image bytes -> patch embeddings in the LM's space.

A vision model directory (``polar model init --vision``) adds a ``vision_config`` to
``config.json`` and ``visual.*`` weights beside the language model's. An image is
decoded (PNG, JPEG, anything Pillow reads), converted to RGB and resized to
``image_size`` square (bilinear), scaled to [-1, 1] and cut into ``patch_size`` patches in
row-major order; each patch is projected to the hidden size, given its position's
embedding, and passed through a small MLP (``merger``, as Qwen2-VL names its projector).
The result, ``tokens_per_image`` rows of ``hidden_size``, replaces the token embeddings
at the image's pad positions in the prompt (``CausalLM._hidden``).

Everything here is plain float32 torch: the engine encodes under ``inference_mode``, the
trainer with autograd through the ``visual.*`` weights, and both give the same numbers.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from msgspec import Struct
from PIL import Image, UnidentifiedImageError

from services.common.tokenization.images import (
    ImageInputError,
    ImageTokens,
    decode_image_url,
    image_digest,
)
from services.engine.modelconfig import VisionConfig

# decompression bombs: a prompt image is resized to a few dozen pixels anyway
MAX_IMAGE_PIXELS = 4096 * 4096


def preprocess(data: bytes, size: int) -> torch.Tensor:
    """Image bytes -> [3, size, size] float32 in [-1, 1]. Raises ImageInputError."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise ImageInputError(f"image is {img.width}x{img.height}: too large")
            rgb = img.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        if isinstance(exc, ImageInputError):
            raise
        raise ImageInputError(f"cannot decode image: {exc}") from exc
    pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return pixels.view(size, size, 3).permute(2, 0, 1).float() / 127.5 - 1.0


def patches(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[n, 3, S, S] -> [n, (S/patch)^2, 3*patch*patch], patches in row-major order."""
    n, c, s, _ = pixels.shape
    g = s // patch
    x = pixels.view(n, c, g, patch, g, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n, g * g, c * patch * patch)


class VisionEncoder:
    def __init__(self, config: VisionConfig, get) -> None:
        self.config = config
        self.patch_t = get("visual.patch_embed.weight").t()
        self.patch_bias = get("visual.patch_embed.bias")
        self.pos = get("visual.pos_embed")
        self.merger_t = get("visual.merger.weight").t()
        self.merger_bias = get("visual.merger.bias")

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] -> [n, tokens_per_image, hidden]."""
        x = patches(pixels, self.config.patch_size) @ self.patch_t + self.patch_bias
        x = F.gelu(x + self.pos)
        return x @ self.merger_t + self.merger_bias


def init_vision_weights(
    config: VisionConfig, hidden: int, generator: torch.Generator, scale: float = 1.0
) -> dict[str, torch.Tensor]:
    """Random ``visual.*`` weights, sized so image embeddings have the scale of token
    embeddings (modelinit's ``std=0.35``)."""

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * (std * scale)

    return {
        "visual.patch_embed.weight": normal(hidden, config.patch_dim, std=config.patch_dim**-0.5),
        "visual.patch_embed.bias": normal(hidden, std=0.02),
        "visual.pos_embed": normal(config.tokens_per_image, hidden, std=0.5),
        # gelu outputs are ~0.5 a component: 0.7/sqrt(hidden) brings a row to ~0.35
        "visual.merger.weight": normal(hidden, hidden, std=0.7 * hidden**-0.5),
        "visual.merger.bias": normal(hidden, std=0.02),
    }


@dataclass(frozen=True)
class SequenceImages:
    """Image embeddings of one sequence: row ``i`` of ``embeds`` replaces the token
    embedding at absolute position ``positions[i]``. ``key`` says which images they are
    (``(start, digest)`` per image): sequences share a packed prompt only if the images
    inside it are the same."""

    positions: torch.Tensor  # [P] int64
    embeds: torch.Tensor  # [P, hidden]
    key: tuple[tuple[int, str], ...] = ()

    def before(self, end: int) -> tuple[tuple[int, str], ...]:
        return tuple(k for k in self.key if k[0] < end)


def place_images(
    spans: list[tuple[int, int]], embeds: torch.Tensor, digests: list[str] | None = None
) -> SequenceImages:
    """Images whose embeddings are ``embeds`` ([n, tokens, hidden]) at the token spans
    ``(start, length)`` of one sequence, in order."""
    if len(spans) != embeds.shape[0]:
        raise ImageInputError(f"{len(spans)} image placeholders but {embeds.shape[0]} images")
    per = embeds.shape[1]
    for start, length in spans:
        if length != per:
            raise ImageInputError(f"image at {start} has {length} tokens, the model reads {per}")
    positions = torch.cat([torch.arange(s, s + n) for s, n in spans]) if spans else None
    digests = digests or [""] * len(spans)
    return SequenceImages(
        positions=positions if positions is not None else torch.zeros(0, dtype=torch.long),
        embeds=embeds.reshape(-1, embeds.shape[-1]),
        key=tuple((s, d) for (s, _), d in zip(spans, digests, strict=True)),
    )


class RequestImages(Struct, frozen=True, kw_only=True):
    """A prompt's images: ``pixels[i]`` (preprocessed, [3, S, S]) fills the token span
    ``spans[i]`` (start, length) and is named ``digests[i]``."""

    pixels: Any  # torch.Tensor [n, 3, S, S]
    spans: list[tuple[int, int]]
    digests: list[str]


def image_bytes(source: str) -> bytes:
    """An ``image_data`` entry as SGLang takes it inline: a data URL or bare base64."""
    if source.startswith("data:"):
        return decode_image_url(source)[1]
    if "://" in source or source.startswith("/"):
        raise ImageInputError("image_data entries must be inline (a data: URL or base64)")
    try:
        return base64.b64decode(source, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageInputError(f"image_data entry is not valid base64: {exc}") from exc


def read_images(
    prompt_ids: list[int],
    sources: list[str],
    tokens: ImageTokens | None,
    config: VisionConfig | None,
) -> RequestImages | None:
    """A prompt's images from its ``image_data`` entries, checked against its image
    tokens: one entry per image span, in order. Raises ImageInputError."""
    if tokens is None or config is None:
        if sources:
            raise ImageInputError("this model reads no images (it has no vision_config)")
        return None
    spans = tokens.spans(prompt_ids)
    if len(spans) != len(sources):
        raise ImageInputError(
            f"the prompt has {len(spans)} image(s) ({tokens.per_image} image tokens each) "
            f"but {len(sources)} image(s) were sent"
        )
    if not spans:
        return None
    data = [image_bytes(s) for s in sources]
    return RequestImages(
        pixels=torch.stack([preprocess(d, config.image_size) for d in data]),
        spans=spans,
        digests=[image_digest(d) for d in data],
    )
