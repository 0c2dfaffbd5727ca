"""Trainers people already use, on Polar, through the whole stack as separate processes:
real ``GRPOTrainer`` steps on CPU with the tiny model (its rollouts are harness sessions:
sandbox, an unmodified agent process, proxy, engine, builder, evaluator), the weights
pushed to the engine after every step; slime's rollout hook against slime's documented
Sample fields; and a session that fails before its first model call still delivering
its (empty, ERROR) trajectory so its group is whole."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import tempfile
from argparse import Namespace
from pathlib import Path

import httpx
import pytest

from examples.trl_grpo.run import task_template, trl_setup
from infra import devstack, localservers
from infra.topology import parse_topology
from schemas import Outcome
from services.trainer.adapters.rollouts import PolarRollouts
from tests.helpers.trainer_stack import admin_headers, operator_nats, stack_credentials
from tests.unit.engine.tiny import tiny_model_dir

pytestmark = [pytest.mark.timeout(900)]
SERVICES = ("model", "proxy", "scheduler", "pool", "executor", "builder", "evaluator")


def topology(state_dir: Path, model_dir: Path) -> str:
    ports = {name: localservers.free_port() for name in ("nats", "redis", *SERVICES)}
    proxy = f"http://127.0.0.1:{ports['proxy']}"
    node = f"{{work_dir: '{state_dir / 'work'}', proxy_url: '{proxy}'}}"
    model = f"{{model_dir: '{model_dir}', served_model_name: polar-tiny, weight_version: '0'}}"
    return f"""
nats_url: nats://127.0.0.1:{ports["nats"]}
redis_url: redis://127.0.0.1:{ports["redis"]}/0
state_dir: '{state_dir}'
startup_timeout_seconds: 180
nodes: [{{name: node0, max_init: 4, ready_buffer: 4, max_run: 8}}]
backends: [{{name: embedded, kind: embedded, url: 'http://127.0.0.1:{ports["model"]}'}}]
services:
  model: {{port: {ports["model"]}, config: {model}}}
  proxy: {{port: {ports["proxy"]}, config: {{mode: token, model_dir: '{model_dir}'}}}}
  scheduler: {{port: {ports["scheduler"]}}}
  pool: {{port: {ports["pool"]}, config: {node}}}
  executor: {{port: {ports["executor"]}, config: {node}}}
  builder: {{port: {ports["builder"]}}}
  evaluator: {{port: {ports["evaluator"]}, config: {node}}}
"""


def digits_task(answer_tokens: int = 8) -> dict:
    """examples/trl_grpo's task template (its one-shot agent answers, the command
    evaluator scores the answer's digit fraction in the live sandbox) on this stack's
    model, with ``answer_tokens`` per answer."""
    template = task_template()
    env = {"ANSWER_TOKENS": str(answer_tokens)}
    template["agent"] = {**template["agent"], "model": "polar-tiny", "env": env}
    return template


@pytest.fixture(scope="module")
def stack():
    state_dir = Path(tempfile.mkdtemp(prefix="polar-adapters-"))
    model_dir = tiny_model_dir()
    topo = parse_topology(topology(state_dir, model_dir), "adapters topology")
    devstack.up(topo)
    try:
        yield topo, model_dir
    finally:
        report = devstack.down(state_dir)
        assert not report.still_listening


def proxy_url(topo) -> str:
    return f"http://127.0.0.1:{topo.services['proxy'].port}"


def test_a_session_failing_before_its_first_call_still_fills_its_group(stack):
    topo, _ = stack
    broken = digits_task()
    broken["max_retries"] = 0
    broken["runtime"] = {
        **broken["runtime"],
        "prepare": [{"action": "exec", "command": "echo no sandbox today >&2; exit 3"}],
    }
    with PolarRollouts(operator_nats(topo), broken, collect_timeout=120) as rollouts:
        (group,) = rollouts.run(["never asked"], num_samples=2)
        rollouts.commit_pending()
    assert group.complete and len(group.trajectories) == 2
    for t in group.trajectories:
        assert t.outcome == Outcome.ERROR and t.traces == [] and t.reward == 0.0
        assert "init failed" in t.metadata["finish_reason"]


def test_trl_grpo_trainer_learns_through_polar(stack, tmp_path):
    """Real GRPOTrainer steps: TRL's prompts become Polar tasks, Polar's sessions come
    back as prompt/completion ids + logprobs + env_mask, the reward is Polar's evaluator's,
    and after each step the weights go to the engine; the reward rises."""
    from trl import GRPOTrainer

    from services.trainer.adapters.trl_grpo import WeightSync, polar_reward, rollout_func

    topo, model_dir = stack
    steps = int(os.environ.get("POLAR_TRL_STEPS", "24"))
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    lr = float(os.environ.get("POLAR_TRL_LR", "5e-4"))
    model, tok, config, dataset = trl_setup(model_dir, tmp_path, steps, lr)  # the example's
    seen: list[dict] = []
    with PolarRollouts(operator_nats(topo), digits_task(), collect_timeout=300) as rollouts:
        inner = rollout_func(rollouts)

        def rollout(prompts, trainer):  # what each step got back, for the checks below
            out = inner(prompts, trainer)
            seen.append(
                {"step": trainer.state.global_step, "versions": out["polar_weight_versions"]}
            )
            return out

        token = stack_credentials(topo).admin_token
        sync = WeightSync(rollouts, proxy_url(topo), tmp_path / "weights", admin_token=token)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[polar_reward],
            args=config,
            train_dataset=dataset,
            processing_class=tok,
            rollout_func=rollout,
            callbacks=[sync],
        )
        trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    record = {
        "steps": steps,
        "reward_per_step": [round(r, 4) for r in rewards],
        "sync_seconds": [round(s, 3) for _, s in sync.synced],
    }
    (Path(tempfile.gettempdir()) / "polar-trl-rewards.json").write_text(json.dumps(record))
    print("TRL through Polar:", json.dumps(record))

    assert len(rewards) == steps and [s for s, _ in sync.synced] == list(range(1, steps + 1))
    version = httpx.get(
        f"{proxy_url(topo)}/admin/weight_version", headers=admin_headers(topo), timeout=10
    ).json()
    assert version["weight_version"] == str(steps)  # the engine serves the last step
    # each step sampled with the weights of the step before (on-policy through Polar)
    for i, row in enumerate(seen):
        assert all(v == [str(row["step"])] for v in row["versions"]), (i, row)
    # the tiny policy sometimes settles on one answer within two or three steps (no reward
    # variance left, so no more gradient): compared with the untrained weights' own step
    # (0.09-0.16 measured), not a window of early steps that a fast collapse already
    # fills with its final value; every run measured ended 0.12 to 0.9 higher
    # (docs/training.md)
    k = max(3, steps // 4)
    untrained, last = rewards[0], sum(rewards[-k:]) / k
    assert last > untrained + 0.05, record


@dataclasses.dataclass
class Sample:
    """slime's Sample as documented (slime/utils/types.py): the fields and Status values
    the adapter fills. Unknown keyword arguments fail here as they would in slime."""

    group_index: int | None = None
    index: int | None = None
    prompt: str | list = ""
    tokens: list = dataclasses.field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict | None = None
    loss_mask: list | None = None
    weight_versions: list = dataclasses.field(default_factory=list)
    rollout_log_probs: list | None = None
    rollout_routed_experts: list | None = None  # an int32 array [len(tokens) - 1, layers, top_k]
    remove_sample: bool = False

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = dataclasses.field(default_factory=dict)
    session_id: str | None = None


class DataSource:
    """slime's data source: ``get_samples(n)`` -> n groups of n_samples_per_prompt."""

    def __init__(self, prompts: list[str], n: int) -> None:
        self.prompts, self.n, self.next = prompts, n, 0

    def get_samples(self, k: int) -> list[list[Sample]]:
        out = []
        for _ in range(k):
            if self.next >= len(self.prompts):
                break
            g = self.next
            self.next += 1
            out.append(
                [
                    Sample(group_index=g, index=g * self.n + i, prompt=self.prompts[g], label="9")
                    for i in range(self.n)
                ]  # fmt: skip
            )
        return out


def test_slime_rollout_turns_groups_into_samples_with_a_prefetch_window(stack):
    from services.trainer.adapters.slime_rollout import SlimeRollout

    topo, _ = stack
    source = DataSource([f"digits {i}" for i in range(6)], n=2)
    with PolarRollouts(operator_nats(topo), digits_task(4), collect_timeout=300) as rollouts:
        slime = SlimeRollout(rollouts, prefetch=2, sample_cls=Sample)
        first = slime.rollout(source, batch_size=2)
        assert len(slime.in_flight) == 2  # the window: the next rollout's groups already run
        second = slime.rollout(source, batch_size=2)
    args = Namespace(n_samples_per_prompt=2)
    for batch, groups in ((first, (0, 1)), (second, (2, 3))):
        assert [g[0].group_index for g in batch] == list(groups)
        for group in batch:
            assert len(group) == args.n_samples_per_prompt
            for s in group:
                assert s.status is Sample.Status.COMPLETED and s.label == "9"
                assert s.response_length == len(s.loss_mask) == len(s.rollout_log_probs) > 0
                assert len(s.tokens) > s.response_length and sum(s.loss_mask) > 0
                assert 0.0 <= s.reward <= 1.0 and s.weight_versions
                assert all(lp <= 0 for lp in s.rollout_log_probs)
                assert s.metadata["polar_session_id"] == s.session_id
            assert len({s.index for s in group}) == 2
