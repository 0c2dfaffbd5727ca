"""The learning demo's recipe in process: held-out accuracy against *steps*, no stack.

The same model (``services.demo.warmstart``), the same warm start, the same task family
(``--task``, default stars: its split and training sampler, ``services.demo.family``),
the same advantages
(``services.trainer.batch.group_samples`` rule: one group per prompt) and the same
``services.trainer.policy.train_step``; only the sampling is done here (the model's own
forward at temperature 1, up to 4 tokens, like the engine) instead of through the
stack, so a recipe's learning speed is measured in steps, free of the machine's load.
Samples are on-policy (``rollout_ahead`` 0) unless ``--lag`` trains each step on the
batch sampled ``lag`` versions earlier, as the demo's pipeline does.

    python tests/bench/sim_stars.py --seeds 0 1 2 --steps 120 --eval-every 10
    python tests/bench/sim_stars.py --seeds 2 --epochs 1 --lr 3e-3   # another recipe
    python tests/bench/sim_stars.py --partial-credit 0 --eps-high 0.2  # exact reward only
    # a sweep: the demo's lag, stop 60 steps after 0.6 held, warm starts kept across runs
    python tests/bench/sim_stars.py --seeds 0 1 2 3 --steps 250 --eval-every 10 --lag 2 \
        --hold 60 --cache /tmp/warm --questions 32   # --hidden 128: a wider model
    # a family of your own (a file, or module:Class); --partial-credit 0.5 to shape it
    python tests/bench/sim_stars.py --task examples/own_task/family.py --seeds 0 1

The reward is the demo's: ``exact_answer`` with the Recipe's ``partial_credit`` (a near
miss earns part of a reward) for an ordered family (stars) unless ``--partial-credit 0``,
exact for an unordered one unless ``--partial-credit W`` (which shapes it anyway: how a
family of unordered classes is pulled onto one answer, docs/training.md).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from evaluators.exact_answer import near_miss
from services.common.tokenization.tokenizer import ChatTokenizer
from services.demo import family as families
from services.demo.family import Item, TaskFamily, load_family
from services.demo.run import Recipe
from services.demo.warmstart import DIMS, Prompts, create_model, warm_start
from services.trainer.batch import Sample
from services.trainer.objective import advantages
from services.trainer.policy import Policy, StepSettings, train_step

MAX_TOKENS = 4


@torch.no_grad()
def generate(model, prompts: list[list[int]], end: int, temperature: float, gen):
    """Sampled (or greedy, temperature 0) responses and their logprobs at temperature 1."""
    seqs = [list(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    lps: list[list[float]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    for _ in range(MAX_TOKENS):
        if not live:
            break
        # identical sequences (8 samples of one prompt) go through the forward once
        keys = [tuple(seqs[i]) for i in live]
        uniq = list(dict.fromkeys(keys))
        at = {k: j for j, k in enumerate(uniq)}
        logits = _last_logits(model, [list(k) for k in uniq])[[at[k] for k in keys]]
        logp = torch.log_softmax(logits, dim=-1)
        if temperature == 0:
            toks = logits.argmax(-1)
        else:
            toks = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[
                :, 0
            ]
        nxt = []
        for j, i in enumerate(live):
            t = int(toks[j])
            outs[i].append(t)
            lps[i].append(float(logp[j, t]))
            seqs[i].append(t)
            if t != end:
                nxt.append(i)
        live = nxt
    return outs, lps


def _last_logits(model, seqs: list[list[int]]) -> torch.Tensor:
    # the trainer's whole-sequence forward; the logits of each sequence's last position
    from services.engine.model import _attend_whole, _bounds

    bounds = _bounds([len(s) for s in seqs])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    x = model._hidden(ids, positions, lambda i, q, k, v: _attend_whole(q, k, v, bounds))
    return model._logits(x[[e - 1 for _, e in bounds]])


def text_of(tok, ids: list[int], end: int) -> str:
    return tok.tokenizer.decode([t for t in ids if t != end])


def heldout_accuracy(policy: Policy, prompts: Prompts, items: list[Item]) -> float:
    outs, _ = generate(
        policy.model(), [prompts.prompt(x.question) for x in items], prompts.end, 0, None
    )
    right = sum(
        text_of(prompts.tok, o, prompts.end).strip() == x.answer
        for o, x in zip(outs, items, strict=True)
    )
    return right / len(items)


def settings(objective: str = "grpo", eps_high: float = 0.2) -> StepSettings:
    return StepSettings(
        objective=objective,
        eps_low=0.2,
        eps_high=eps_high,
        ratio_cap=3.0,
        kl_coef=0.0,
        max_staleness=4,
        stale_policy="drop",
        stale_weight=0.1,
        dr_grpo_max_tokens=256,
        skip_zero_advantage=True,
        mismatch_threshold=1e-4,
        grad_clip=1.0,
    )


def reward(text: str, item: Item, credit: tuple[float, int] | None) -> float:
    """``exact_answer``'s reward for one answer (its near-miss credit when given)."""
    if text.strip() == item.answer:
        return 1.0
    return near_miss(text, item.answer, credit) if credit else 0.0


def batch(
    policy, prompts, items, group, version, gen, objective, temperature, credit
) -> list[Sample]:
    flat = [x for x in items for _ in range(group)]
    outs, lps = generate(
        policy.model(), [prompts.prompt(x.question) for x in flat], prompts.end, temperature, gen
    )
    rewards = [
        reward(text_of(prompts.tok, o, prompts.end), x, credit)
        for o, x in zip(outs, flat, strict=True)
    ]
    samples = []
    for q, item in enumerate(items):
        rs = rewards[q * group : (q + 1) * group]
        advs = advantages(rs, objective)
        for j in range(group):
            k = q * group + j
            p = prompts.prompt(item.question)
            samples.append(
                Sample(
                    task_id="sim",
                    session_id=f"s{j}",
                    trace_index=q,
                    tokens=[*p, *outs[k]],
                    prompt_len=len(p),
                    mask=[1] * len(outs[k]),
                    behavior=lps[k],
                    versions=(str(version),),
                    reward=rs[j],
                    advantage=advs[j],
                )
            )
    return samples


def warm_key(family: TaskFamily, seed: int, dims: dict, sft: tuple[int, int, float]) -> str:
    """What a warm start depends on: the task (its name, answers and training questions),
    the seed, the widths and the SFT settings (steps, batch, lr)."""
    return f"warm-{families.key(family)}-{seed}-d{dims['hidden_size']}-{sft[0]}x{sft[1]}-{sft[2]:g}"


def run_seed(seed: int, args, work: Path) -> dict:
    recipe = Recipe(seed=seed)
    family = load_family(args.task)
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    dims = DIMS
    if args.hidden:
        dims = {**DIMS, "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden}
    sft = (
        args.sft_steps or recipe.sft_steps,
        args.sft_batch or recipe.sft_batch,
        args.sft_lr or recipe.sft_lr,
    )
    # the warm start depends only on the task, the seed, the widths and the SFT settings:
    # a cache dir (--cache) lets a sweep of RL recipes skip it after a seed's first run
    key = warm_key(family, seed, dims, sft)
    cached = args.cache / key if args.cache else None
    if cached and (cached / "config.json").exists():
        model_dir, ws_seconds = cached, 0.0
    else:
        base = create_model(work / f"init{seed}", seed, dims=dims)
        out = cached or work / key
        ws = warm_start(base, out, seed=seed, steps=sft[0], batch=sft[1], lr=sft[2], family=family)
        model_dir, ws_seconds = ws.model_dir, ws.seconds
    torch.manual_seed(seed)
    policy = Policy(model_dir, lr=args.lr or recipe.lr, device="cpu")
    prompts = Prompts(ChatTokenizer.load(model_dir))
    train, heldout = family.train(), family.heldout()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    s = settings(args.objective, args.eps_high or recipe.clip_eps_high)
    credit = recipe.partial_credit if args.partial_credit is None and family.ordered else None
    if args.partial_credit:
        credit = (args.partial_credit, args.credit_window)
    questions = args.questions or recipe.questions
    group = args.group or recipe.group_size
    curve, pending = [], []
    t0 = time.perf_counter()
    train_s = 0.0
    for step in range(args.steps + 1):
        if step % args.eval_every == 0:
            curve.append((step, round(heldout_accuracy(policy, prompts, heldout), 3)))
            if args.hold and _held(curve, args.target, args.hold, args.floor):
                break
        if step == args.steps:
            break
        items = family.sample(rng, questions, train)
        pending.append(
            batch(
                policy, prompts, items, group, step, gen, args.objective, args.temperature, credit
            )
        )
        if len(pending) <= args.lag:
            continue
        todo = pending.pop(0)
        for e in range(args.epochs or recipe.updates_per_batch):
            train_s += train_step(policy, todo, step, s, check=e == 0).train_seconds
    accs = [a for _, a in curve]
    hit = next((st for st, a in curve if a >= args.target), None)
    after = [a for st, a in curve if hit is not None and st > hit]
    return {
        "seed": seed,
        "acc_step0": accs[0],
        "first_ge_target_step": hit,
        "min_after_hit": min(after) if after else None,
        "best": max(accs),
        "final": accs[-1],
        "steps_run": curve[-1][0],
        "warm_start_s": round(ws_seconds, 1),
        "median_train_s": round(train_s / max(1, args.steps), 3),
        "wall_s": round(time.perf_counter() - t0, 1),
        "curve": curve,
    }


def _held(curve, target: float, hold: int, floor: float) -> bool:
    """Whether the target was reached at least ``hold`` steps ago, never below ``floor``
    since (the run can stop there: the sweep's question is answered)."""
    hit = next((st for st, a in curve if a >= target), None)
    if hit is None or curve[-1][0] - hit < hold:
        return False
    return all(a >= floor for st, a in curve if st >= hit)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--task", default="stars", help="the family: a name, a file, module:Class")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--questions", type=int, default=0)
    ap.add_argument("--group", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.0)
    ap.add_argument("--sft-steps", type=int, default=0)
    ap.add_argument("--sft-batch", type=int, default=0)
    ap.add_argument("--sft-lr", type=float, default=0.0)
    ap.add_argument("--objective", default="grpo")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lag", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=0, help="updates per batch (the Recipe's)")
    ap.add_argument("--target", type=float, default=0.6)
    ap.add_argument("--eps-high", type=float, default=0.0, help="upper clip (the Recipe's)")
    ap.add_argument(
        "--partial-credit", type=float, default=None, help="near-miss weight; 0: exact only"
    )
    ap.add_argument("--credit-window", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=0, help="model width (intermediate 4x)")
    ap.add_argument("--cache", type=Path, default=None, help="dir keeping the warm starts")
    ap.add_argument(
        "--hold", type=int, default=0, help="stop once the target has held this many steps"
    )
    ap.add_argument("--floor", type=float, default=0.55, help="what 'held' means (--hold)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            r = run_seed(seed, args, Path(tmp))
            rows.append(r)
            print(json.dumps(r), flush=True)
    hits = [r["first_ge_target_step"] for r in rows]
    print(
        json.dumps(
            {
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "reached": sum(h is not None for h in hits),
                "held": sum(
                    r["first_ge_target_step"] is not None
                    and (r["min_after_hit"] or 1.0) >= args.floor
                    for r in rows
                ),
                "steps": hits,
                "worst_step": None if None in hits else max(hits),
                "median_final": statistics.median(r["final"] for r in rows),
            }
        )
    )


if __name__ == "__main__":
    main()
