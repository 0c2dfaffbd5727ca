"""The example's model: the tiny vision-language model, then a format-only warm start.

``polar model init --vision`` gives a random model that answers with random tokens, so no
answer is ever a count and every reward is 0. The warm start (supervised, through the
same image path the engine and trainer use) teaches the answer's *form*: a digit, then
end of turn. Every target digit is drawn independently of the image, so it teaches
nothing about counting: a sample is right by chance (~1 in 9), and a GRPO group's
rewards differ.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from examples.count_stars.images import star_image
from schemas import ImageSpan
from services.common.tokenization import ChatTokenizer
from services.common.tokenization.images import image_digest
from services.demo.warmstart import save_for_rl, supervised_step
from services.engine.modelinit import init_model_dir
from services.trainer.batch import Sample
from services.trainer.policy import Policy

QUESTION = "How many stars are in this image? Answer with one digit."
COUNTS = range(1, 10)
INIT_SCALE = 0.05  # near-flat distributions: the warm start then leaves no favourite digit


def question_ids(tok: ChatTokenizer) -> list[int]:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}
    content = [image, {"type": "text", "text": QUESTION}]
    return tok.render_ids([{"role": "user", "content": content}])


def create_model(out: Path, seed: int = 0) -> Path:
    return init_model_dir(out, seed=seed, vision=True, init_scale=INIT_SCALE)


def warm_start(
    base: Path, out: Path, *, seed: int = 0, steps: int = 40, batch: int = 16, lr: float = 3e-3
) -> tuple[float, float]:
    """SFT ``base`` on (star image, random digit) pairs; write ``out``. (final loss, s)"""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = ChatTokenizer.load(base)
    prompt = question_ids(tok)
    ((start, length),) = tok.images.spans(prompt)
    end = tok.tokenizer.token_to_id("<|im_end|>")
    images = [star_image(c, seed=10_000 + k) for c in COUNTS for k in range(3)]
    policy = Policy(base, lr=lr)
    policy.add_images({image_digest(i): i for i in images})
    loss = torch.tensor(0.0)
    for _ in range(steps):
        samples = []
        for _ in range(batch):
            answer = [*tok.encode(str(rng.choice(COUNTS))), end]
            span = ImageSpan(digest=image_digest(rng.choice(images)), start=start, length=length)
            samples.append(
                Sample("warm", "warm", 0, prompt + answer, len(prompt), [1] * len(answer),
                       [0.0] * len(answer), ("0",), 0.0, 0.0, (span,))
            )  # fmt: skip
        model = policy.model()
        rows = model.sequence_logprobs(
            [s.tokens for s in samples],
            [s.prompt_len for s in samples],
            policy.sample_images(samples, model),
        )
        loss = supervised_step(policy, rows)
    save_for_rl(policy, out)
    return float(loss.detach()), time.perf_counter() - t0
