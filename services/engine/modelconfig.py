"""The subset of a Hugging Face ``config.json`` the embedded engine needs (Llama/Qwen
families, and Qwen3-MoE's mixture-of-experts layers).

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
    "Qwen3MoeForCausalLM",
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


class MoeConfig(Struct, frozen=True, kw_only=True):
    """A Qwen3-MoE model's sparse layers: a softmax router over ``num_experts`` SwiGLU
    experts of width ``intermediate_size``, ``top_k`` of them per token."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]  # the decoder layers that are MoE, in model order

    @property
    def shape(self) -> dict[str, int]:
        """What /model_info reports (SGLang clients size routing arrays with it)."""
        return {
            "moe_layers": len(self.layers),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
        }


def parse_moe(raw: dict, num_layers: int) -> MoeConfig:
    """Qwen3-MoE's keys, with transformers' defaults: a layer is MoE unless it is in
    ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid (as Qwen3MoeDecoderLayer
    decides). Transformers writes ``num_local_experts``; Qwen's own files ``num_experts``."""
    experts = int(raw.get("num_experts", raw.get("num_local_experts", 128)))
    top_k = int(raw.get("num_experts_per_tok", 8))
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    if experts == 0:  # transformers makes every layer dense then
        return MoeConfig(
            num_experts=0, top_k=top_k, intermediate_size=0, norm_topk_prob=False, layers=()
        )
    if not 0 < top_k <= experts or step < 1:
        raise ModelLoadError(
            f"MoE config: top {top_k} of {experts} experts, decoder_sparse_step {step}"
        )
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=int(raw.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        layers=layers,
    )


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
    moe: MoeConfig | None = None  # a mixture-of-experts model's sparse layers


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
    layers = int(raw["num_hidden_layers"])
    eos = raw.get("eos_token_id")
    moe = parse_moe(raw, layers) if arch == "Qwen3MoeForCausalLM" else None
    if moe is not None and not moe.layers:
        moe = None  # every layer dense: served (and reported) as a dense model
    return ModelConfig(
        architecture=arch,
        model_type=str(raw.get("model_type", "")),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        # an all-MoE config may leave the dense width out
        intermediate_size=int(
            raw["intermediate_size"] if moe is None else raw.get("intermediate_size", 0)
        ),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        vision=parse_vision(raw["vision_config"]) if raw.get("vision_config") else None,
        moe=moe,
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{model_dir} has no config.json")
    try:
        return parse_config(json.loads(path.read_text("utf-8")))
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: {exc!r}") from exc
