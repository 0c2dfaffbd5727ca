"""TRL's ``GRPOTrainer`` on Polar, one command: ``just example-trl-grpo``.

    python -m examples.trl_grpo.run              # 12 steps
    python -m examples.trl_grpo.run --steps 2    # the smoke size `just test` runs

1. A tiny random model (``polar model init``: a Qwen2 architecture that ``transformers``
   loads) is written and served by a whole stack on free ports (its own NATS and Valkey,
   the embedded engine, proxy, scheduler, pool, executor, builder, evaluator, dashboard),
   which writes ``<state_dir>/polar.env`` as ``polar up`` does: the stack's URLs, its
   credentials and the admin token, where every client finds them.
2. TRL trains the same weights on CPU. Each prompt TRL hands out becomes one Polar task
   of ``num_generations`` sessions: ``agent.py`` (one chat call through the proxy) in a
   sandbox, scored by ``score.py`` (the fraction of digits in its answer; the
   ``command`` evaluator). Each session comes back as prompt/completion ids, the
   engine's logprobs and a loss mask (``rollout_func``), its reward as ``polar_reward``.
3. After every optimizer step ``WeightSync`` saves the policy and pushes it to the
   engine through the proxy's ``/admin/update_weights``, which needs the stack's admin
   token (``admin_token=``; without it: 401). The next step samples with the new weights.

The code docs/training.md shows is ``train`` below, as it runs here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from examples.runner import stack
from infra import devstack
from services.demo.topology import MODEL_NAME, stack_topology
from services.engine.modelinit import init_model_dir

HERE = Path(__file__).resolve().parent
PROMPTS = [f"Write digits, round {i}." for i in range(4)]


def task_template() -> dict:
    """Every task's template (a TaskRequest without instruction and num_samples, which
    TRL's prompt and ``num_generations`` fill): the agent answers, the command
    evaluator scores the answer in the same sandbox."""
    python = sys.executable
    return {
        "timeout_seconds": 300,
        "agent_timeout_seconds": 120,
        "runtime": {
            "backend": "local",
            "env": {"PATH": f"{Path(python).parent}:/usr/local/bin:/usr/bin:/bin"},
            "prepare": [
                {"action": "upload_file", "src": str(HERE / "agent.py"), "dest": "agent.py"},
                {"action": "upload_file", "src": str(HERE / "score.py"), "dest": "score.py"},
            ],
        },
        "agent": {"harness": "shell", "command": f"{python} agent.py", "model": MODEL_NAME},
        "builder": {"name": "prefix_merging"},
        "evaluator": {
            "name": "command",
            "runtime": "live",
            "config": {"command": f"{python} score.py"},
        },
    }


def trl_setup(model_dir: Path, out: Path, steps: int, lr: float):
    """(model, tokenizer, GRPOConfig, dataset): TRL's side, on CPU."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir)  # the weights the engine serves
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = Dataset.from_list([{"prompt": p} for p in PROMPTS * 50])
    config = GRPOConfig(
        output_dir=str(out / "trl"),
        num_generations=4,  # sessions per prompt: one Polar task each
        per_device_train_batch_size=8,  # two prompts a step
        max_steps=steps,
        learning_rate=lr,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        dataloader_num_workers=0,
    )
    return model, tokenizer, config, dataset


def train(model, tokenizer, config, dataset, task_template: dict, out: Path):
    """GRPOTrainer with generation and weights through the stack ``$POLAR_ENV_FILE``
    names (docs/training.md shows this body); returns (the trainer, its WeightSync)."""
    from trl import GRPOTrainer

    from services.client import connection
    from services.trainer.adapters.rollouts import PolarRollouts
    from services.trainer.adapters.trl_grpo import WeightSync, polar_reward, rollout_func

    conn = connection.from_environment()  # $POLAR_ENV_FILE: the polar.env `polar up` wrote
    with PolarRollouts(conn.nats_url, task_template) as rollouts:
        sync = WeightSync(rollouts, conn.proxy_url, out / "weights", admin_token=conn.admin_token)
        trainer = GRPOTrainer(
            model=model,  # the same weights the engine serves
            processing_class=tokenizer,
            reward_funcs=[polar_reward],  # the evaluator's reward; add your own functions too
            args=config,  # GRPOConfig(num_generations=4, per_device_train_batch_size=8, ...)
            train_dataset=dataset,  # a "prompt" column: text or messages
            rollout_func=rollout_func(rollouts),
            callbacks=[sync],  # after each optimizer step: push the weights to the engine
        )
        trainer.train()
    return trainer, sync


def served_version(proxy_url: str, admin_token: str | None) -> str:
    headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
    r = httpx.get(f"{proxy_url}/admin/weight_version", headers=headers, timeout=10)
    return str(r.json().get("weight_version"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=5e-4, help="Adam learning rate")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="a model to start from (read only; default: a new `polar model init` one)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    out = Path(tempfile.mkdtemp(prefix="polar-trl-grpo-"))
    model_dir = args.model_dir.resolve() if args.model_dir else init_model_dir(out / "model")
    t0 = time.monotonic()
    with stack(lambda state: stack_topology(state, model_dir, max_run=8, max_batch=16)) as topo:
        os.environ["POLAR_ENV_FILE"] = str(devstack.env_file(Path(topo.state_dir)))
        trl = trl_setup(model_dir, out, args.steps, args.lr)
        trainer, sync = train(*trl, task_template(), out)
        from services.client import connection

        conn = connection.from_environment()
        version = served_version(conn.proxy_url, conn.admin_token)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    for step, (reward, (_, seconds)) in enumerate(zip(rewards, sync.synced, strict=False), 1):
        print(f"step {step:>3}  reward {reward:.3f}  weight push {seconds:.2f}s")
    record = {"steps": args.steps, "rewards": [round(r, 3) for r in rewards], "served": version}
    print(json.dumps(record))
    print(f"done in {time.monotonic() - t0:.0f}s; files in {out}")
    synced = [s for s, _ in sync.synced]
    ok = len(rewards) == args.steps and synced == list(range(1, args.steps + 1))
    return 0 if ok and version == str(args.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
