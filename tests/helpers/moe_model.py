"""A tiny random-weight Qwen3-MoE model directory, written by transformers itself.

``moe_model_dir()`` builds it once per user and recipe (``infra.usercache``'s cache, keyed
by this module, the transformers version and the Qwen3 vocabulary fixture it takes its
tokenizer from); ``moe_model_dir(root)`` builds it once under ``root`` instead (a pytest
tmp dir). The directory holds the real Qwen3 tokenizer and chat template
(``model_families.family_model_dir("qwen3")``) beside a ``Qwen3MoeForCausalLM`` saved
with ``save_pretrained``: 3 layers (the middle one dense, through ``mlp_only_layers``, so
the MoE layers are 0 and 2), width 64, 4 heads over 2 kv heads, 8 experts of width 32,
top-2 with renormalised weights. Weights are drawn wider than transformers' defaults
(fixed seed) so that routing decides something: peaked next-token distributions, and a
router whose top-2 is clear of the third.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from infra.usercache import cache_root, install_lock
from tests.helpers.model_families import family_model_dir

SEED = 0
DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,  # the dense layer's
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
}
MOE_LAYERS = (0, 2)
# standard deviations by parameter name suffix (the rest: norms, ones)
STDS = {
    "embed_tokens.weight": 0.35,
    "lm_head.weight": 0.35,  # tied: the same tensor, whichever name it is listed under
    "self_attn.q_proj.weight": 0.08,
    "self_attn.k_proj.weight": 0.08,
    "self_attn.v_proj.weight": 0.08,
    "self_attn.o_proj.weight": 0.08,
    "mlp.gate.weight": 0.3,  # the router
    "mlp.experts.gate_up_proj": 0.15,
    "mlp.experts.down_proj": 0.15,
    "mlp.gate_proj.weight": 0.08,
    "mlp.up_proj.weight": 0.08,
    "mlp.down_proj.weight": 0.08,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def moe_model_dir(root: str | Path | None = None) -> Path:
    """The tiny Qwen3-MoE directory: under ``root`` when given, else in the user cache.
    Safe across processes: built under a lock into a temporary folder, then renamed."""
    vocab = family_model_dir("qwen3")
    if root is not None:
        final = Path(root) / "qwen3-moe-tiny"
    else:
        base = cache_root() or Path(__file__).resolve().parents[2] / ".state"
        final = base / "model-families" / f"qwen3_moe-tiny-{_build_key(vocab)}"
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with install_lock(final):
        if not final.exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
            tmp.chmod(0o755)
            try:
                _write(vocab, tmp)
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build_key(vocab: Path) -> str:
    key = hashlib.sha256(Path(__file__).read_bytes())
    key.update(f"{vocab.name} transformers={importlib.metadata.version('transformers')}".encode())
    return key.hexdigest()[:12]


def _write(vocab: Path, out: Path) -> None:
    import torch
    import transformers

    family = json.loads((vocab / "config.json").read_text("utf-8"))
    generation = json.loads((vocab / "generation_config.json").read_text("utf-8"))
    config = transformers.Qwen3MoeConfig(
        **DIMS,
        vocab_size=family["vocab_size"],
        bos_token_id=generation.get("bos_token_id"),
        eos_token_id=generation["eos_token_id"],
        pad_token_id=generation.get("pad_token_id"),
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=4096,
        architectures=["Qwen3MoeForCausalLM"],
    )
    model = transformers.Qwen3MoeForCausalLM(config)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            std = next((v for k, v in STDS.items() if name.endswith(k)), None)
            if std is None:
                param.fill_(1.0)  # RMSNorm weights
            else:
                param.copy_(torch.randn(param.shape, generator=g) * std)
    model.save_pretrained(out)  # what transformers writes: its expert layout, its config keys
    for name in TOKENIZER_FILES:
        shutil.copyfile(vocab / name, out / name)


# -- transformers' view of the fixture (the tests compare the engine's with it) -------------
def hf_model(moe_dir):
    import transformers

    return transformers.Qwen3MoeForCausalLM.from_pretrained(
        str(moe_dir), dtype=torch.float32
    ).eval()


def hf_pass(hf, batch: list[list[int]]):
    """Transformers' log-softmax [b, n, vocab], its routing [b, n, layers, top_k] and each
    router's input [b * n, hidden], from one forward (routers hooked)."""
    from services.trainer.routing_replay import moe_routers

    routers = moe_routers(hf)
    picked, inputs = [None] * len(routers), [None] * len(routers)
    hooks = []
    for i, router in enumerate(routers):

        def hook(_, args, out, i=i):
            inputs[i], picked[i] = args[0].detach().clone(), out[2].detach().clone()

        hooks.append(router.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = hf(torch.tensor(batch)).logits
    finally:
        for h in hooks:
            h.remove()
    b, n = len(batch), len(batch[0])
    rows = torch.stack(picked, dim=1).view(b, n, len(routers), -1)
    return torch.log_softmax(logits, dim=-1), rows, inputs


def picked_logprobs(logprobs: torch.Tensor, ids: list[int], start: int) -> torch.Tensor:
    """log p(ids[j] | ids[:j]) for j >= start from one sequence's [n, vocab] log-softmax."""
    targets = torch.tensor(ids[start:])
    return logprobs[start - 1 : len(ids) - 1].gather(1, targets[:, None])[:, 0]
