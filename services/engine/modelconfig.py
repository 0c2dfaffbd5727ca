"""The subset of a Hugging Face ``config.json`` the embedded engine needs (Llama/Qwen families).

Only architectures whose forward pass ``model.py`` implements are accepted; anything else
is a ModelLoadError with the reason, never a silently wrong forward.
"""

from __future__ import annotations

import json
from pathlib import Path

from msgspec import Struct

SUPPORTED_ARCHITECTURES = (
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
)


class ModelLoadError(ValueError):
    """The model directory cannot be served (missing files, unsupported architecture)."""


class VisionConfig(Struct, frozen=True, kw_only=True):
    image_size: int
    patch_size: int
    tokens_per_image: int
    image_token_id: int

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size * self.patch_size


def parse_vision(raw: dict) -> VisionConfig:
    """``config.json``'s ``vision_config`` (a vision model: ``services/engine/vision.py``).
    Raises ModelLoadError when its numbers do not fit."""
    cfg = VisionConfig(
        image_size=int(raw["image_size"]),
        patch_size=int(raw["patch_size"]),
        tokens_per_image=int(raw["tokens_per_image"]),
        image_token_id=int(raw["image_token_id"]),
    )
    side, rem = divmod(cfg.image_size, max(cfg.patch_size, 1))
    if cfg.patch_size <= 0 or rem or side * side != cfg.tokens_per_image:
        raise ModelLoadError(
            f"vision_config: {cfg.image_size}px images in {cfg.patch_size}px patches do not "
            f"make {cfg.tokens_per_image} tokens"
        )
    return cfg


class ModelConfig(Struct, frozen=True, kw_only=True):
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_id: list[int]
    vision: VisionConfig | None = None  # a vision model's image encoder


def _rope_theta(raw: dict) -> float:
    scaling = raw.get("rope_scaling") or {}
    params = raw.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type") or "default"
    if kind != "default":
        raise ModelLoadError(f"rope scaling {kind!r} is not supported by the embedded engine")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def parse_config(raw: dict) -> ModelConfig:
    """ModelConfig from a config.json mapping. Raises ModelLoadError."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"architectures {archs} not supported; the embedded engine serves "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    eos = raw.get("eos_token_id")
    return ModelConfig(
        architecture=arch,
        model_type=str(raw.get("model_type", "")),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        vision=parse_vision(raw["vision_config"]) if raw.get("vision_config") else None,
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{model_dir} has no config.json")
    try:
        return parse_config(json.loads(path.read_text("utf-8")))
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: {exc!r}") from exc
