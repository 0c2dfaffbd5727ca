"""verl's side of tests/integration/test_verl_agent_loop.py, run in verl's own venv
(infra/verl.py): verl's agent-loop machinery drives ``PolarAgentLoop`` against the
test's stack, and what verl received comes back as one JSON document on stdout.

It imports verl and the adapter first, then reads one JSON line on stdin (the stack's
URLs, written once the stack is up: the imports overlap its start). Then:

1. ``PolarRouter``, as verl's router plugin loader builds it, is given "verl's server"
   (the stack's embedded engine) and serves Polar's proxy from it;
2. verl's legacy ``AgentLoopWorker.generate_sequences`` runs 4 prompts x 3 runs (a
   sound group, one with a failing session, one that times out, one the test cancels
   in Polar) and pads the outputs into its batch (``_postprocess``); verl's GRPO
   advantage runs on that batch;
3. the engine is moved to weight version 7 (as after a sync), and a V1-trainer group
   runs as verl's V1 worker runs one (``session_id`` per run, settled by
   ``_settle_session_tasks``): its outputs through ``AgentLoopOutput.as_dict()`` and
   the V1 advantage (``compute_advantage_for_multi_trajectories``).

Nothing here imports Polar beyond the adapter, so the Polar modules loaded at the end
are the adapter's import boundary.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

T0 = time.monotonic()
import httpx  # noqa: E402
import hydra  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf, open_dict  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopWorker,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
)
from verl.protocol import DataProto  # noqa: E402
from verl.workers.rollout.router import _load_router_yaml  # noqa: E402

from services.trainer.adapters.verl_agent_loop import PolarRouter  # noqa: E402
from services.trainer.adapters.verl_sessions import groups_for  # noqa: E402

IMPORT_SECONDS = time.monotonic() - T0


def _later_imports() -> None:
    """verl's trainer modules (a third of the imports' time) load on a thread while the
    first groups' sessions run; ``later()`` waits for them."""
    global core_algos, _settle_session_tasks, compute_advantage_for_multi_trajectories
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.v1.agent_loop_tq import _settle_session_tasks
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories


_LATER = threading.Thread(target=_later_imports, daemon=True)


def later() -> None:
    _LATER.join()


RECIPE = Path(__file__).resolve().parents[2] / "examples" / "verl_grpo"
N = 3  # runs per prompt: verl's rollout.n
PROMPTS = {  # prompt -> the Polar task fields that sample carries (extra_info.polar_task)
    "sound": {},
    "failing": {"agent": {"env": {"VERL_TEST_MODE": "fail_second"}}},
    "timeout": {"agent_timeout_seconds": 3, "agent": {"env": {"VERL_TEST_MODE": "hang"}}},
    "cancelled": {"agent_timeout_seconds": 40, "agent": {"env": {"VERL_TEST_MODE": "wait"}}},
}


def verl_config(args: dict, *, use_v1: bool):
    """The recipe (examples/verl_grpo/polar_grpo.yaml) composed as verl's main composes
    it, at this test's size, its task the test's."""
    overrides = [
        f"actor_rollout_ref.model.path={args['model_dir']}",
        "data.max_prompt_length=256",
        "data.max_response_length=64",
        f"actor_rollout_ref.rollout.n={N}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={RECIPE / 'agent_loops.yaml'}",
        f"trainer.use_v1={str(use_v1).lower()}",
        f"polar.nats_url={args['nats_url']}",
        "polar.group_timeout_seconds=60",
    ]
    with initialize_config_dir(config_dir=str(RECIPE), version_base=None):
        cfg = compose(config_name="polar_grpo", overrides=overrides)
    with open_dict(cfg):
        cfg.polar.task = OmegaConf.create(args["task"])
    return cfg


def prompt_batch(names: list[str], step: int) -> DataProto:
    """verl's generation batch: one row per prompt (its raw chat, uid, index, agent and
    extra_info), repeated ``N`` times interleaved, as the trainer repeats it."""
    rows = len(names)
    chats, extra = np.empty(rows, dtype=object), np.empty(rows, dtype=object)
    for i, name in enumerate(names):
        chats[i] = [{"role": "user", "content": f"say something ({name})"}]
        extra[i] = {"index": i, "polar_task": PROMPTS[name]}
    batch = DataProto(
        non_tensor_batch={
            "raw_prompt": chats,
            "uid": np.array([f"uid-{n}" for n in names], dtype=object),
            "index": np.arange(rows),
            "agent_name": np.array(["polar"] * rows, dtype=object),
            "extra_info": extra,
        },
        meta_info={"global_steps": step, "validate": False},
    )
    return batch.repeat(repeat_times=N, interleave=True)


async def cancel_when_submitted(settings, uid: str) -> str:
    """Cancel the Polar task of ``uid``'s group once it is out, as a user's `polar
    cancel` would; again every half second until its sessions are back (a cancel that reaches
    the scheduler before the task is registered finds nothing to cancel)."""
    groups = groups_for(settings)
    while True:
        for task_id, group in list(groups.in_flight.items()):
            if group.uid == uid:
                while not group.done.done():
                    await groups.cancel(task_id, "cancelled by the test")
                    await asyncio.sleep(0.5)
                return task_id
        await asyncio.sleep(0.05)


def unpadded(out: DataProto) -> list[dict]:
    """Each row of verl's padded batch, its padding taken off by verl's own masks."""
    b, width = out.batch, out.batch["prompts"].shape[1]
    rows = []
    for r in range(len(out)):
        att = b["attention_mask"][r]
        p_att, r_att = att[:width].bool(), att[width:].bool()
        n = int(r_att.sum())
        rows.append(
            {
                "prompt_ids": b["prompts"][r][p_att].tolist(),
                "response_ids": b["responses"][r][:n].tolist(),
                "response_mask": b["response_mask"][r][:n].tolist(),
                "rollout_log_probs": b["rollout_log_probs"][r][:n].tolist(),
                "rm_score": float(b["rm_scores"][r].sum()),
                "uid": str(out.non_tensor_batch["uid"][r]),
                "shapes": {k: list(b[k].shape) for k in ("prompts", "responses", "input_ids")},
                "extra": {
                    k: _plain(out.non_tensor_batch[k][r])
                    for k in out.non_tensor_batch
                    if k.startswith("polar_") or k.endswith("_global_steps")
                },
            }
        )
    return rows


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    return value


async def legacy(args: dict) -> dict:
    cfg = verl_config(args, use_v1=False)
    worker = AgentLoopWorker(cfg, llm_client=None)
    batch = prompt_batch(list(PROMPTS), step=1)
    canceller = asyncio.create_task(cancel_when_submitted(worker_settings(cfg), "uid-cancelled"))
    t0 = time.monotonic()
    out = await worker.generate_sequences(batch)
    seconds = time.monotonic() - t0
    cancelled = await canceller
    later()
    scores = out.batch["rm_scores"]
    adv, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=scores,
        response_mask=out.batch["response_mask"],
        index=out.non_tensor_batch["uid"],
    )
    rows = unpadded(out)
    for row, a in zip(rows, adv, strict=True):
        row["advantage"] = float(a[0]) if a.abs().sum() else 0.0
    step = cpu_step(out, adv, cfg, args["model_dir"])
    return {"rows": rows, "seconds": seconds, "cancelled_task": cancelled, "cpu_step": step}


def cpu_step(out: DataProto, advantages: torch.Tensor, cfg, model_dir: str) -> dict:
    """One policy-gradient step on CPU over the batch verl built: the policy's logprobs
    recomputed by the same weights the engine served (HF transformers, float32), verl's
    PPO clipped loss (``compute_policy_loss_vanilla``, Polar's captured logprobs as the
    old policy's, verl's GRPO advantages), backward, one AdamW step, the loss again.
    verl's trainer itself cannot run here (the test's docstring says why)."""
    from transformers import AutoModelForCausalLM
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.torch_functional import logprobs_from_logits_naive

    torch.manual_seed(0)
    b = out.batch
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    width = b["prompts"].shape[1]
    mask = b["response_mask"].float()

    def logprobs() -> torch.Tensor:
        logits = model(
            input_ids=b["input_ids"],
            attention_mask=b["attention_mask"],
            position_ids=b["position_ids"],
        ).logits
        return logprobs_from_logits_naive(logits[:, width - 1 : -1], b["responses"])

    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    old = b["rollout_log_probs"]

    def loss_of(lp: torch.Tensor):
        return core_algos.compute_policy_loss_vanilla(
            old_log_prob=old, log_prob=lp, advantages=advantages, response_mask=mask, config=actor
        )

    lp = logprobs()
    drift = float(((lp.detach() - old).abs() * mask).max())
    loss, metrics = loss_of(lp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after, _ = loss_of(logprobs())
    return {
        "loss": float(loss),
        "loss_after": float(after),
        "ppo_kl": metrics["actor/ppo_kl"],
        "max_logprob_drift": drift,
        "tokens": int(mask.sum()),
    }


def worker_settings(cfg):
    from services.trainer.adapters.verl_agent_loop import settings_of

    return settings_of(cfg)


async def v1(args: dict) -> dict:
    """One prompt's group the way verl's V1 worker runs it (``_run_prompt``): ``N``
    runs with ``session_id``, settled together; the outputs verl keeps go through
    ``as_dict()`` and the V1 advantage."""
    cfg = verl_config(args, use_v1=True)
    worker = AgentLoopWorker(cfg, llm_client=None)
    prompt = {
        "raw_prompt": [{"role": "user", "content": "say something (v1)"}],
        "uid": "uidv1",
        "index": 0,
        "global_steps": 8,
        "extra_info": {"polar_task": PROMPTS["failing"]},
    }

    async def one(session_id: int):
        loop = hydra.utils.instantiate(
            config=_agent_loop_registry["polar"],
            trainer_config=DictConfigWrap(config=cfg),
            server_manager=None,
            tokenizer=worker.tokenizer,
            processor=None,
            hf_model_type=worker.hf_model_type,
            dataset_cls=worker.dataset_cls,
            data_config=DictConfigWrap(cfg.data),
            tools=ToolListWrap([]),
        )
        return await loop.run({"temperature": 1.0}, session_id=session_id, **prompt)

    tasks = [asyncio.create_task(one(i)) for i in range(N)]
    errors = await _settle_session_tasks(tasks)
    status = "failure" if errors else "finished"
    kept = [(i, t.result()) for i, t in enumerate(tasks) if not t.exception()]
    fields = [out.as_dict() for _, out in kept]
    keys = [f"{prompt['uid']}_{i}_0" for i, _ in kept]
    data = DataProto(
        batch=TensorDict(
            {
                "rm_scores": _padded([f["rm_scores"] for f in fields]),
                "response_mask": _padded([f["response_mask"] for f in fields]),
            },
            batch_size=len(fields),
        ),
        non_tensor_batch={"uid": np.array([prompt["uid"]] * len(fields), dtype=object)},
    )
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    data = compute_advantage_for_multi_trajectories(
        data, keys, adv_estimator=core_algos.AdvantageEstimator.GRPO, num_repeat=N
    )
    return {
        "status": status,
        "errors": [f"{type(e).__name__}: {e}" for e in errors],
        "kept": [
            {
                "session_index": i,
                "keys": sorted(f),
                "prompts": len(f["prompts"]),
                "responses": len(f["responses"]),
                "response_mask": f["response_mask"].tolist(),
                "rollout_log_probs": f["rollout_log_probs"].tolist(),
                "reward": float(f["rm_scores"].sum()),
                "extra_fields": f["extra_fields"],
                "advantage": float(data.batch["advantages"][k][0]),
            }
            for k, ((i, _), f) in enumerate(zip(kept, fields, strict=True))
        ],
    }


def _padded(rows: list) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)


async def main(args: dict) -> dict:
    timings = {"import": IMPORT_SECONDS}
    t0 = time.monotonic()
    # the recipe's router.yaml as verl's plugin loader reads it, at this test's place
    os.environ["VERL_MODEL_DIR"] = args["model_dir"]
    router_config = _load_router_yaml(str(RECIPE / "router.yaml"))
    router_config["polar"].update(
        python=args["python"],
        env_file=args["env_file"],
        port=args["proxy_port"],
        kind="embedded",  # the test's stand-in for verl's server speaks SGLang's API
        model="tiny",
    )
    os.environ["POLAR_ENGINE_API_KEY"] = args["engine_key"]  # the proxy presents it
    router = PolarRouter({args["engine"]: None}, router_config)
    timings["router"] = time.monotonic() - t0
    try:
        first = await legacy(args)
        timings["legacy"] = first["seconds"]
        headers = {"authorization": f"Bearer {args['admin_token']}"}
        proxy = f"http://127.0.0.1:{args['proxy_port']}"
        body = {"model_path": args["model_dir"], "version": "7"}  # as after verl's sync
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(f"{proxy}/admin/update_weights", json=body, headers=headers)
            r.raise_for_status()
        t1 = time.monotonic()
        second = await v1(args)
        timings["v1"] = time.monotonic() - t1
    finally:
        for groups in _all_groups():
            await groups.close()
        router.stop()
    modules = sorted(
        m for m in sys.modules if m.split(".")[0] in ("schemas", "services", "proxy", "infra")
    )
    timings["total"] = time.monotonic() - T0
    return {"legacy": first, "v1": second, "modules": modules, "timings": timings}


def _all_groups():
    from services.trainer.adapters import verl_sessions

    return list(verl_sessions._GROUPS.values())


if __name__ == "__main__":
    print(json.dumps({"ready": IMPORT_SECONDS}), flush=True)
    _LATER.start()
    given = json.loads(sys.stdin.readline())
    result = asyncio.run(main(given))
    print(json.dumps(result, default=str), flush=True)
