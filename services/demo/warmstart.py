"""The demo's model: a tiny byte-vocabulary model, then a format-only SFT warm start.

The warm start teaches the answer's *form* (one of the family's answers, then end of
turn) and nothing about the task: every target is drawn uniformly from the family's
answer space independently of the question asked (for stars: a number 0-10, whatever
the line), so the best it can learn is "say some answer". Held-out accuracy after it
stays near chance (1 / the number of answers), which ``tests/unit/demo/test_family.py``
checks.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.tokenization.tokenizer import ChatTokenizer
from services.demo.family import Item, TaskFamily, load_family, max_tokens
from services.engine.modelinit import PRESETS, init_model_dir
from services.trainer.policy import Policy

DIMS = PRESETS["demo"].dims  # what `polar model init --preset demo` writes


@dataclass(frozen=True)
class WarmStart:
    model_dir: Path
    steps: int
    seconds: float
    final_loss: float


class Prompts:
    """Prompt ids per question (rendered once) and answer ids per answer."""

    def __init__(self, tok: ChatTokenizer) -> None:
        self.tok = tok
        self.end = tok.tokenizer.token_to_id("<|im_end|>")
        self._cache: dict[str, list[int]] = {}

    def prompt(self, question: str) -> list[int]:
        if question not in self._cache:
            msgs = [{"role": "user", "content": question}]
            self._cache[question] = self.tok.render_ids(msgs, None, True)
        return self._cache[question]

    def answer(self, text: str) -> list[int]:
        return [*self.tok.tokenizer.encode(text).ids, self.end]


# near-flat distributions at the start: the warm start then keeps the answers
# near-uniform (a wide init leaves a favourite answer that RL collapses onto)
INIT_SCALE = PRESETS["demo"].init_scale

# vLLM's CPU attention refuses head_dim 16 ("Unsupported CPU attention configuration:
# head_dim=16"): on vLLM the same widths with 2 heads of 32
DIMS_VLLM = PRESETS["demo-vllm"].dims


def create_model(out: Path, seed: int, *, dims: dict[str, int] = DIMS) -> Path:
    return init_model_dir(out, seed=seed, dims=dims, tokenizer="bytes", init_scale=INIT_SCALE)


def warm_start(
    base: Path,
    out: Path,
    *,
    seed: int,
    steps: int = 60,
    batch: int = 32,
    lr: float = 3e-3,
    family: str | TaskFamily = "stars",
) -> WarmStart:
    """SFT ``base`` on (training question, uniformly random answer) pairs; write ``out``."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # the stack starts on the other core meanwhile
    rng = random.Random(seed)
    fam = load_family(family)
    train = [i.question for i in fam.train()]
    answers = list(fam.answers)
    prompts = Prompts(ChatTokenizer.load(base))
    policy = Policy(base, lr=lr, device="cpu")
    loss = torch.tensor(0.0)
    for _ in range(steps):
        seqs, starts = [], []
        for _ in range(batch):
            prompt = prompts.prompt(rng.choice(train))
            seqs.append([*prompt, *prompts.answer(answers[rng.randrange(len(answers))])])
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
def greedy_accuracy(model_dir: Path, items: list[Item], family: TaskFamily) -> float:
    """In-process greedy accuracy on ``items`` (a check of the warm start, not the demo's
    metric: the demo measures held-out accuracy through the stack)."""
    from services.engine.weights import load_model

    model = load_model(model_dir)
    prompts = Prompts(ChatTokenizer.load(model_dir))
    right = 0
    for item in items:
        ids = list(prompts.prompt(item.question))
        out: list[int] = []
        cache = model.new_cache()
        chunk = ids
        for _ in range(max_tokens(family)):
            token = int(model.forward([chunk], [cache])[0].argmax())
            if token == prompts.end:
                break
            out.append(token)
            chunk = [token]
        right += prompts.tok.tokenizer.decode(out) == item.answer
    return right / len(items)
