"""The trainer adapters' pure parts: prompts to tasks, groups to TRL's rollout output
and to slime's Sample fields, traces to padded tensors (no servers)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest

from schemas import ImageSpan, Outcome, Trace, Trajectory, VersionSpan
from services.client import Group
from services.trainer.adapters.collate import collate
from services.trainer.adapters.rollouts import RolloutError, prompt_text, task_request
from services.trainer.adapters.slime_rollout import sample_fields
from services.trainer.adapters.trl_grpo import distinct_prompts, main_trace, trl_batch


def trace(chain: int, prompt, response, mask, *, side_call=None, reward=None) -> Trace:
    lps = [-0.5 if m else None for m in mask]
    return Trace(
        trace_id=f"s/{chain}",
        chain_id=chain,
        prompt_ids=list(prompt),
        response_ids=list(response),
        loss_mask=list(mask),
        response_logprobs=lps,
        side_call=side_call,
        reward=reward,
        weight_versions=["3"],
        version_spans=[VersionSpan(version="3", start=0, end=len(response))],
    )


def traj(i: int, traces, *, outcome=Outcome.COMPLETED, reward=1.0) -> Trajectory:
    return Trajectory(
        session_id=f"t-{i:04d}",
        task_id="t",
        outcome=outcome,
        builder="prefix_merging",
        traces=list(traces),
        reward=reward,
        eval_status="ok",
        metadata={"num_samples": 2, "sample_index": i},
    )


@dataclass
class Member:  # what Group.trajectories reads
    trajectory: Trajectory


def group(*ts, complete=True) -> Group:
    return Group("t", [Member(t) for t in ts], complete=complete)  # type: ignore[arg-type]


MULTI = traj(
    1,
    [
        trace(0, [1], [9, 9], [1, 1], side_call="title"),
        trace(1, [1, 2], [5, 6, 7, 8], [1, 0, 0, 1]),  # a tool turn: env tokens masked
        trace(2, [1, 3], [5], [1]),
    ],
    reward=0.5,
)


def test_prompt_text_and_task_request():
    assert prompt_text("add 2") == "add 2"
    convo = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert prompt_text(convo) == "hi"
    assert prompt_text([{"role": "user", "content": [{"type": "text", "text": "a"}]}]) == "a"
    with pytest.raises(RolloutError, match="cannot make an instruction"):
        prompt_text(42)
    template = {"agent": {"command": "x"}, "metadata": {"run": "r1"}}
    task = task_request(template, "p-1", "hi", 4, {"prompt_index": 0})
    assert task == {
        "agent": {"command": "x"},
        "task_id": "p-1",
        "instruction": "hi",
        "num_samples": 4,
        "metadata": {"run": "r1", "prompt_index": 0},
    }


def test_distinct_prompts_checks_trl_repeats():
    assert distinct_prompts(["a", "a", "b", "b"], 2) == ["a", "b"]
    with pytest.raises(RolloutError, match="not runs"):
        distinct_prompts(["a", "a", "b"], 2)
    with pytest.raises(RolloutError, match="not one prompt repeated"):
        distinct_prompts(["a", "b", "b", "b"], 2)


def test_main_trace_is_the_longest_trainable_non_side_call():
    assert main_trace(MULTI).chain_id == 1
    assert main_trace(traj(0, [], outcome=Outcome.ERROR, reward=0.0)) is None


def test_trl_batch_rows_in_sample_order_with_env_mask_and_short_groups_filled():
    one = traj(0, [trace(0, [1, 2], [4, 2], [1, 1])])
    failed = traj(3, [], outcome=Outcome.ERROR, reward=0.0)
    out = trl_batch([group(MULTI, one), group(failed, complete=False)], 2, pad_id=0)
    assert out["polar_session"] == ["t-0000", "t-0001", "t-0003", None]
    assert out["prompt_ids"][:2] == [[1, 2], [1, 2]]
    assert out["completion_ids"][1] == [5, 6, 7, 8] and out["env_mask"][1] == [1, 0, 0, 1]
    assert out["logprobs"][1] == [-0.5, 0.0, 0.0, -0.5]  # no logprob where nothing sampled
    # nothing sampled, or missing: a masked placeholder, out of the baseline (None)
    assert out["env_mask"][2:] == [[0], [0]] and out["completion_ids"][2] == [0]
    assert out["polar_reward"] == [1.0, 0.5, None, None]
    assert out["polar_outcome"] == ["completed", "completed", "error", "missing"]
    assert out["polar_traces"] == [1, 3, 0, 0]
    for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask"):
        assert len(out[key]) == 4
    rows = zip(out["completion_ids"], out["env_mask"], out["logprobs"], strict=True)
    assert all(len(c) == len(m) == len(lp) for c, m, lp in rows)


def test_slime_sample_fields():
    f = sample_fields(MULTI, group_index=7, index=15)
    assert f["tokens"] == [1, 2, 5, 6, 7, 8] and f["response_length"] == 4
    assert f["loss_mask"] == [1, 0, 0, 1] and f["rollout_log_probs"] == [-0.5, 0.0, 0.0, -0.5]
    assert (f["group_index"], f["index"], f["reward"], f["status"]) == (7, 15, 0.5, "completed")
    assert f["weight_versions"] == ["3"] and f["metadata"]["polar_version_spans"] == [["3", 0, 4]]
    empty = sample_fields(traj(0, [], outcome=Outcome.ERROR, reward=0.0), 0, 0)
    assert empty["status"] == "failed" and empty["loss_mask"] == [0] and empty["reward"] == 0.0
    assert empty["response_length"] == len(empty["tokens"]) == 1


def test_collate_pads_with_attention_and_loss_masks():
    torch = pytest.importorskip("torch")
    a = trace(0, [1, 2], [5, 6, 7], [1, 0, 1], reward=1.0)
    b = trace(1, [3], [8], [1])
    batch = collate([a, b], pad_id=0, with_rewards=True)
    assert batch["input_ids"].tolist() == [[1, 2, 5, 6, 7], [3, 8, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]]
    assert batch["logprobs"].tolist() == [[0, 0, -0.5, 0, -0.5], [0, -0.5, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [list(range(5))] * 2
    assert torch.equal(batch["rewards"], torch.tensor([1.0, 0.0]))
    assert "images" not in batch  # text traces: no images key
    with pytest.raises(ValueError, match="at least one"):
        collate([], pad_id=0)


def test_collate_carries_each_rows_images_at_their_positions():
    pytest.importorskip("torch")
    image = ImageSpan(digest="sha256:ab", start=1, length=1)
    a = msgspec.structs.replace(trace(0, [1, 9, 2], [5], [1]), images=[image])
    batch = collate([a, trace(1, [3], [8], [1])], pad_id=0)
    assert batch["images"] == [[image], []]
    assert batch["input_ids"][0, image.start].item() == 9
