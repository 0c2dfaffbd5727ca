"""TRL's ``GRPOTrainer`` on Polar: generation and weights are Polar's, the loss is TRL's.

``rollout_func(rollouts)`` is a ``GRPOTrainer(rollout_func=...)`` (TRL >= 1.16): TRL hands
it the process's prompts, each repeated ``num_generations`` times in a row; Polar runs
one task per distinct prompt (``num_generations`` harness sessions) and the function
returns, per session in prompt order: ``prompt_ids``, ``completion_ids`` (the trace's
response: sampled tokens and, for a prefix-merged multi-turn trace, the tool results and
template glue between them), ``logprobs`` (the engine's, 0.0 where nothing was sampled)
and ``env_mask`` (the trace's loss mask: 1 on sampled tokens). Extra fields go to TRL's
reward functions: ``polar_reward`` (the evaluator's reward; None for a session with
nothing to train on or a member missing from a short group: TRL leaves those out of the
baseline and gives them advantage 0, as ``services/trainer/batch.py`` does), ``polar_session``,
``polar_outcome``, ``polar_traces``, ``polar_weight_versions`` and
``polar_tool_parse_failures`` (the session's tool calls that did not parse). A session
with such calls is handled by ``tool_parse_failures`` first, as Polar's trainer does
(``services/trainer/toolparse.py``: ``zero_reward`` by default).

A session is one TRL sample: its main trace (the trainable, non-side-call trace with the
most sampled tokens). Sessions with several main traces (sub-agents, compaction) give
TRL that one only; ``polar_traces`` says how many there were.

``WeightSync`` is the callback that closes the loop: after each optimizer step it saves
the policy as a Hugging Face directory and POSTs ``/admin/update_weights {model_path,
version}`` to the proxy (version = the step number), then commits the step's groups.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from schemas import Trace, Trajectory
from services.client import Group
from services.trainer.adapters.rollouts import PolarRollouts, RolloutError
from services.trainer.toolparse import DEFAULT_RULE, apply_rule, check_rule, tool_failures

Batch = dict[str, list[Any]]


def main_trace(t: Trajectory) -> Trace | None:
    """The session's trace TRL trains on: trainable, not a side call, most sampled tokens."""
    main = [tr for tr in t.traces if tr.trainable and any(tr.loss_mask) and not tr.side_call]
    return max(main, key=lambda tr: sum(tr.loss_mask), default=None)


def _row(t: Trajectory | None, pad_id: int) -> dict[str, Any]:
    trace = main_trace(t) if t is not None else None
    if trace is None:  # nothing sampled (failed before its first call) or missing: masked,
        # and out of the baseline (reward None), as Polar's trainer leaves empty members out
        return {
            "prompt_ids": [pad_id],
            "completion_ids": [pad_id],
            "logprobs": [0.0],
            "env_mask": [0],
            "polar_reward": None,
        }
    return {
        "prompt_ids": list(trace.prompt_ids),
        "completion_ids": list(trace.response_ids),
        "logprobs": [0.0 if lp is None else lp for lp in trace.response_logprobs],
        "env_mask": list(trace.loss_mask),
        "polar_reward": t.reward,
    }


def trl_batch(
    groups: list[Group],
    num_generations: int,
    pad_id: int,
    tool_parse_failures: str = DEFAULT_RULE,
) -> Batch:
    """``rollout_func``'s answer for these groups (one per distinct prompt, in order):
    ``num_generations`` rows each, members in sample order; a session with no trainable
    trace, and each member missing from a short group, is a masked row whose
    ``polar_reward`` is None. ``tool_parse_failures``: the rule for sessions whose tool
    calls did not parse (``keep`` | ``zero_reward`` | ``mask``)."""
    out: Batch = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
    extra: Batch = {
        k: []
        for k in ("polar_reward", "polar_session", "polar_outcome", "polar_traces")
        + ("polar_weight_versions", "polar_tool_parse_failures")
    }
    for group in groups:
        members = sorted(group.trajectories, key=_sample_index)[:num_generations]
        members = [apply_rule(t, tool_parse_failures) for t in members]
        members += [None] * (num_generations - len(members))
        for t in members:
            row = _row(t, pad_id)
            for key in out:
                out[key].append(row[key])
            trace = main_trace(t) if t is not None else None
            extra["polar_reward"].append(row["polar_reward"])
            extra["polar_session"].append(t.session_id if t is not None else None)
            extra["polar_outcome"].append(str(t.outcome) if t is not None else "missing")
            extra["polar_traces"].append(len(t.traces) if t is not None else 0)
            extra["polar_weight_versions"].append(list(trace.weight_versions) if trace else [])
            extra["polar_tool_parse_failures"].append(tool_failures(t) if t is not None else 0)
    return {**out, **extra}


def _sample_index(t: Trajectory) -> int:
    i = t.metadata.get("sample_index")
    return i if isinstance(i, int) else 0


def distinct_prompts(prompts: list[Any], num_generations: int) -> list[Any]:
    """TRL repeats each prompt ``num_generations`` times in a row: one of each."""
    if num_generations < 1 or len(prompts) % num_generations:
        raise RolloutError(
            f"{len(prompts)} prompts are not runs of num_generations={num_generations}"
        )
    distinct = prompts[::num_generations]
    for i, prompt in enumerate(distinct):
        run = prompts[i * num_generations : (i + 1) * num_generations]
        if any(p != prompt for p in run):
            raise RolloutError(f"prompts {i * num_generations}.. are not one prompt repeated")
    return distinct


def rollout_func(
    rollouts: PolarRollouts, *, tool_parse_failures: str = DEFAULT_RULE
) -> Callable[[list[Any], Any], Batch]:
    """A ``GRPOTrainer`` ``rollout_func`` backed by ``rollouts``; ``tool_parse_failures``:
    the rule for sessions whose tool calls did not parse."""
    check_rule(tool_parse_failures)

    def polar_rollout(prompts: list[Any], trainer: Any) -> Batch:
        training = trainer.model.training
        g = trainer.num_generations if training else trainer.num_generations_eval
        groups = rollouts.run(distinct_prompts(prompts, g), g)
        pad = trainer.processing_class.pad_token_id
        return trl_batch(groups, g, 0 if pad is None else pad, tool_parse_failures)

    return polar_rollout


def polar_reward(completions: list[Any], polar_reward: list[float | None], **_: Any) -> list:
    """A TRL reward function: the reward Polar's evaluator gave each session."""
    return list(polar_reward)


try:  # a TrainerCallback when transformers is there; the rest of this module needs none
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - transformers is a dev/train dependency
    TrainerCallback = object  # type: ignore[assignment,misc]


class WeightSync(TrainerCallback):  # type: ignore[misc]
    """After each optimizer step: save the policy, push it to every engine through the
    proxy (version = the step), commit the step's groups. ``every``: sync every k steps."""

    def __init__(
        self,
        rollouts: PolarRollouts,
        proxy_url: str,
        out_dir: str | Path,
        *,
        every: int = 1,
        admin_token: str | None = None,
        timeout: float = 300.0,
    ) -> None:
        self.rollouts, self.proxy_url, self.out_dir = rollouts, proxy_url.rstrip("/"), Path(out_dir)
        self.every, self.timeout = every, timeout
        self.headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.synced: list[tuple[int, float]] = []  # (step, seconds the sync took)

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
        self.rollouts.commit_pending()  # the optimizer step used them
        if state.global_step % self.every == 0 and model is not None:
            self.push(model, state.global_step, processing_class)
        return control

    def push(self, model: Any, step: int, processing_class: Any = None) -> str:
        t0 = time.monotonic()
        path = self.out_dir / f"step-{step}"
        model.save_pretrained(path, safe_serialization=True)
        if processing_class is not None:
            processing_class.save_pretrained(path)
        body = {"model_path": str(path), "version": str(step)}
        r = httpx.post(
            f"{self.proxy_url}/admin/update_weights",
            json=body,
            headers=self.headers,
            timeout=self.timeout,
        )
        if r.status_code != 200 or not r.json().get("ok"):
            raise RolloutError(f"weight update to step {step} refused: {r.status_code} {r.text}")
        self.synced.append((step, time.monotonic() - t0))
        return r.json()["weight_version"]
