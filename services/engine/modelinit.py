"""``polar model init DIR``: write a tiny, real Hugging Face model directory.

The directory holds a Qwen2-architecture causal LM with random weights (fixed seed), a
byte-level BPE tokenizer trained here on a generated corpus, and Polar's ChatML chat
template with Qwen/Hermes tool calls. It loads with ``transformers`` (AutoTokenizer,
Qwen2ForCausalLM) and with the embedded engine. No network, and the same bytes every time.

``vision=True`` makes a vision-language model: three more special tokens
(``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, Qwen2-VL's names), a
``vision_config`` and ``visual.*`` weights (the embedded engine's image encoder:
``vision.py``), and a template that renders image parts as the placeholder. Transformers
loads its language model (the ``visual.*`` weights are then unused); the embedded engine
serves all of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from services.common.tokenization.images import (
    IMAGE_PAD,
    VISION_TEMPLATE_PRELUDE,
    VISION_TOKENS,
)
from services.common.tokenization.template import default_template
from services.engine.corpus import generate_corpus
from services.engine.modelconfig import VisionConfig
from services.engine.vision import init_vision_weights
from services.engine.weights import save_tensors

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
VOCAB_SIZE = 4096
# a vision model's images: 64x64 pixels in 16x16 patches, 16 tokens each
VISION_DEFAULTS = {"image_size": 64, "patch_size": 16, "tokens_per_image": 16}
DEFAULT_DIMS = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@dataclass(frozen=True)
class Preset:
    """A model ``polar model init --preset NAME`` writes."""

    tokenizer: str
    dims: dict[str, int]
    init_scale: float
    about: str


_DEMO_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
PRESETS = {
    "tiny": Preset("bpe", DEFAULT_DIMS, 1.0, "4,096-id BPE, width 128 (tests, --scripted)"),
    # near-flat distributions (init scale 0.05): a warm start keeps its answers near-uniform
    "demo": Preset("bytes", _DEMO_DIMS, 0.05, "the learning demo's: 265 byte ids, width 64"),
    # vLLM's CPU attention refuses head_dim 16: the same widths with 2 heads of 32
    "demo-vllm": Preset(
        "bytes",
        {**_DEMO_DIMS, "num_attention_heads": 2, "num_key_value_heads": 2},
        0.05,
        "the learning demo's on vLLM (2 heads of 32)",
    ),
}


def train_tokenizer(seed: int = 0, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE (Qwen2-style pre-tokenization); ids 0-2 are the special tokens and the
    tool/think tags are the last six ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(generate_corpus(seed), trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ADDED_TOKENS])
    return tok


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer with no merges: the three special tokens, one id per byte
    (3-258), then the tool/think tags. Every character of a digit or ``*``/``.`` line is its
    own token, which tiny models learn to count far faster than BPE merges like ``*.``."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ADDED_TOKENS])
    return tok


TOKENIZERS = {"bpe": train_tokenizer, "bytes": byte_tokenizer}


def _tokenizer_config(tok: Tokenizer, vision: bool = False) -> dict:
    decoder = {}
    extra = VISION_TOKENS if vision else ()
    for text in SPECIAL_TOKENS + ADDED_TOKENS + extra:
        decoder[str(tok.token_to_id(text))] = {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": text in SPECIAL_TOKENS or text in extra,
        }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "split_special_tokens": False,
        "chat_template": (VISION_TEMPLATE_PRELUDE if vision else "") + default_template(),
    }


def model_config(
    vocab_size: int, eos_ids: list[int], pad_id: int, dims: dict | None = None
) -> dict:
    d = {**DEFAULT_DIMS, **(dims or {})}
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        **d,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": d["num_hidden_layers"],
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": eos_ids[0],
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def vision_config(tok: Tokenizer) -> dict:
    return {**VISION_DEFAULTS, "image_token_id": tok.token_to_id(IMAGE_PAD)} | {
        "vision_start_token_id": tok.token_to_id(VISION_TOKENS[0]),
        "vision_end_token_id": tok.token_to_id(VISION_TOKENS[1]),
    }


def init_weights(config: dict, seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random Qwen2 weights, drawn wider than HF's default so the untrained model's
    next-token distributions are peaked (sampling knobs visibly matter); the output head is
    untied so the model does not just echo its input token. ``scale`` multiplies every
    standard deviation (a model to be trained wants flat distributions: e.g. 0.05)."""
    g = torch.Generator().manual_seed(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * (std * scale)

    tensors = {
        "model.embed_tokens.weight": normal(v, h, std=0.35),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": normal(v, h, std=0.4),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": torch.ones(h),
                p + "post_attention_layernorm.weight": torch.ones(h),
                p + "self_attn.q_proj.weight": normal(h, h, std=0.08),
                p + "self_attn.q_proj.bias": normal(h, std=0.02),
                p + "self_attn.k_proj.weight": normal(kv, h, std=0.08),
                p + "self_attn.k_proj.bias": normal(kv, std=0.02),
                p + "self_attn.v_proj.weight": normal(kv, h, std=0.08),
                p + "self_attn.v_proj.bias": normal(kv, std=0.02),
                p + "self_attn.o_proj.weight": normal(h, h, std=0.08),
                p + "mlp.gate_proj.weight": normal(inter, h, std=0.08),
                p + "mlp.up_proj.weight": normal(inter, h, std=0.08),
                p + "mlp.down_proj.weight": normal(h, inter, std=0.08),
            }
        )
    if config.get("vision_config"):  # drawn last: a text model's weights stay the same
        raw = config["vision_config"]
        vision = VisionConfig(
            image_size=raw["image_size"],
            patch_size=raw["patch_size"],
            tokens_per_image=raw["tokens_per_image"],
            image_token_id=raw["image_token_id"],
        )
        tensors.update(init_vision_weights(vision, h, g, scale))
    return tensors


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", "utf-8")


def init_model_dir(
    model_dir: str | Path,
    seed: int = 0,
    dims: dict | None = None,
    tokenizer: str = "bpe",
    init_scale: float = 1.0,
    vision: bool = False,
) -> Path:
    """Write the tiny model directory (tokenizer seeded by 0, weights by ``seed``):
    ``tokenizer`` is ``bpe`` (4,096 ids trained on the agent corpus) or ``bytes``
    (265 ids, no merges); ``dims`` overrides ``DEFAULT_DIMS``; ``init_scale`` multiplies
    the weights' standard deviations; ``vision`` adds the image encoder (module doc)."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {sorted(TOKENIZERS)}, not {tokenizer!r}")
    unknown = set(dims or {}) - set(DEFAULT_DIMS)
    if unknown:
        raise ValueError(f"unknown model dims {sorted(unknown)}; known: {sorted(DEFAULT_DIMS)}")
    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = TOKENIZERS[tokenizer]()
    if vision:
        tok.add_special_tokens(
            [AddedToken(t, normalized=False, special=True) for t in VISION_TOKENS]
        )
    eos_ids = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    pad_id = tok.token_to_id("<|endoftext|>")
    config = model_config(tok.get_vocab_size(with_added_tokens=True), eos_ids, pad_id, dims)
    if vision:
        config["vision_config"] = vision_config(tok)
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tok, vision))
    _write_json(
        out / "special_tokens_map.json",
        {
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        },
    )
    _write_json(
        out / "generation_config.json",
        {
            "eos_token_id": eos_ids,
            "pad_token_id": pad_id,
            "do_sample": True,
            "temperature": 1.0,
            "top_p": 1.0,
        },
    )
    save_tensors(init_weights(config, seed, init_scale), out)
    _write_json(out / "config.json", config)  # last: its presence marks a complete directory
    return out


def reseed_weights(model_dir: str | Path, target_dir: str | Path, seed: int) -> Path:
    """Copy ``model_dir`` to ``target_dir`` with freshly seeded weights (a 'new checkpoint'
    for weight-update tests and demos)."""
    src, dst = Path(model_dir), Path(target_dir)
    dst.mkdir(parents=True, exist_ok=True)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "config.json",
        "generation_config.json",
    ):
        (dst / name).write_bytes((src / name).read_bytes())
    config = json.loads((src / "config.json").read_text("utf-8"))
    save_tensors(init_weights(config, seed), dst)
    return dst
