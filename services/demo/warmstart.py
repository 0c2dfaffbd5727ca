"""The demo's model: a tiny byte-vocabulary model, then a format-only SFT warm start.

The warm start teaches the answer's *form* (a bare number, then end of turn) and nothing
about counting: every target is a number drawn uniformly from 0-10 independently of the
line asked about, so the best it can learn is "say some number". Held-out accuracy after
it stays at chance (~1/11), which ``tests/unit/demo/test_warmstart.py`` checks.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.tokenization.tokenizer import ChatTokenizer
from services.demo import stars
from services.engine.modelinit import init_model_dir
from services.trainer.policy import Policy

DIMS = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


@dataclass(frozen=True)
class WarmStart:
    model_dir: Path
    steps: int
    seconds: float
    final_loss: float


class Prompts:
    """Question prompt ids per line (rendered once) and answer ids per number."""

    def __init__(self, tok: ChatTokenizer) -> None:
        self.tok = tok
        self.end = tok.tokenizer.token_to_id("<|im_end|>")
        self._cache: dict[str, list[int]] = {}

    def prompt(self, line: str) -> list[int]:
        if line not in self._cache:
            msgs = [{"role": "user", "content": stars.question(line)}]
            self._cache[line] = self.tok.render_ids(msgs, None, True)
        return self._cache[line]

    def answer(self, text: str) -> list[int]:
        return [*self.tok.tokenizer.encode(text).ids, self.end]


INIT_SCALE = 0.05  # near-flat distributions at the start: the warm start then keeps the
# numbers near-uniform (a wide init leaves a favourite answer that RL collapses onto)


# vLLM's CPU attention refuses head_dim 16 ("Unsupported CPU attention configuration:
# head_dim=16"): on vLLM the same widths with 2 heads of 32
DIMS_VLLM = {**DIMS, "num_attention_heads": 2, "num_key_value_heads": 2}


def create_model(out: Path, seed: int, *, dims: dict[str, int] = DIMS) -> Path:
    return init_model_dir(out, seed=seed, dims=dims, tokenizer="bytes", init_scale=INIT_SCALE)


def warm_start(
    base: Path, out: Path, *, seed: int, steps: int = 60, batch: int = 32, lr: float = 3e-3
) -> WarmStart:
    """SFT ``base`` on (training line, uniformly random number) pairs; write ``out``."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # the stack starts on the other core meanwhile
    rng = random.Random(seed)
    train, _ = stars.split()
    prompts = Prompts(ChatTokenizer.load(base))
    policy = Policy(base, lr=lr, device="cpu")
    loss = torch.tensor(0.0)
    for _ in range(steps):
        seqs, starts = [], []
        for _ in range(batch):
            prompt = prompts.prompt(rng.choice(train))
            seqs.append([*prompt, *prompts.answer(str(rng.randrange(11)))])
            starts.append(len(prompt))
        loss = supervised_step(policy, policy.model().sequence_logprobs(seqs, starts))
    save_for_rl(policy, out)
    return WarmStart(out, steps, time.perf_counter() - t0, float(loss.detach()))


def supervised_step(policy: Policy, rows: list[torch.Tensor]) -> torch.Tensor:
    """One SFT step on the answer tokens' logprobs ``rows`` (mean NLL, grad norm 1.0)."""
    loss = -torch.cat(rows).mean()
    policy.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(policy.params.values()), 1.0)
    policy.optimizer.step()
    return loss


def save_for_rl(policy: Policy, out: Path) -> None:
    policy.save(out)
    (out / "optimizer.pt").unlink(missing_ok=True)  # RL starts its own optimizer


@torch.inference_mode()
def greedy_accuracy(model_dir: Path, lines: list[str]) -> float:
    """In-process greedy accuracy on ``lines`` (a check of the warm start, not the demo's
    metric: the demo measures held-out accuracy through the stack)."""
    from services.engine.weights import load_model

    model = load_model(model_dir)
    prompts = Prompts(ChatTokenizer.load(model_dir))
    right = 0
    for line in lines:
        ids = list(prompts.prompt(line))
        out: list[int] = []
        cache = model.new_cache()
        chunk = ids
        for _ in range(4):
            token = int(model.forward([chunk], [cache])[0].argmax())
            if token == prompts.end:
                break
            out.append(token)
            chunk = [token]
        right += prompts.tok.tokenizer.decode(out) == stars.answer(line)
    return right / len(lines)
