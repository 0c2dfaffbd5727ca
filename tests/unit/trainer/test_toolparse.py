"""The rule for sessions whose tool calls did not parse: keep, zero_reward, mask, on a
batch through ``group_samples``, the adapters' rows and ``collate`` (no servers)."""

from dataclasses import dataclass

import pytest

from schemas import Trace, Trajectory
from schemas.trajectory import ToolFailure, TraceToolParse
from services.client import Group
from services.trainer.adapters.collate import collate
from services.trainer.adapters.slime_rollout import sample_fields
from services.trainer.adapters.trl_grpo import trl_batch
from services.trainer.batch import GroupCounts, group_samples
from services.trainer.config import ConfigError, parse_config
from services.trainer.toolparse import apply_rule, tool_failures
from tests.unit.trainer.test_batch import traj as batch_traj

SPAN = ToolFailure(seq=1, kind="malformed", detail="bad JSON", start=2, end=4)
WHOLE = ToolFailure(seq=0, kind="unknown_tool", detail="no tool named 'rm'")


def trace(i: int, reward=None, *failures: ToolFailure) -> Trace:
    n = 6
    return Trace(
        trace_id=f"x/{i}",
        chain_id=i,
        prompt_ids=[1, 2, 3],
        response_ids=list(range(20 + i, 20 + i + n)),
        loss_mask=[1, 1, 1, 1, 0, 1],
        response_logprobs=[-0.5, -0.5, -0.5, -0.5, None, -0.5],
        reward=reward,
        weight_versions=["0"],
        tool_parse=TraceToolParse(family="qwen3", turns=2, checked=3, failures=list(failures)),
    )


def traj(sid: str, reward, traces, *, eval_status="ok") -> Trajectory:
    meta = {"num_samples": 3, "sample_index": int(sid[-1])}
    return batch_traj(sid, reward, traces, eval_status=eval_status, **meta)


def batch_of(rule: str, counts: GroupCounts | None = None):
    """Three sessions of one task: s0 solved it with a tool call that did not parse, s1
    solved it cleanly, s2 failed."""
    members = [
        traj("s0", 1.0, [trace(0, 1.0, SPAN)]),
        traj("s1", 1.0, [trace(0, 1.0)]),
        traj("s2", 0.0, [trace(0, 0.0)]),
    ]
    counts = counts if counts is not None else GroupCounts()
    return group_samples(members, 3, "dr_grpo", "auto", counts, rule), counts


def test_keep_trains_the_batch_as_delivered_and_counts_the_failure():
    samples, counts = batch_of("keep")
    assert [(s.session_id, s.reward) for s in samples] == [("s0", 1.0), ("s1", 1.0), ("s2", 0.0)]
    assert samples[0].mask == [1, 1, 1, 1, 0, 1]
    assert counts.tool_parse_failed == 1 and counts.as_dict()["tool_parse_failed"] == 1


def test_zero_reward_scores_the_session_with_a_failed_call_as_a_failure():
    samples, counts = batch_of("zero_reward")
    assert [(s.session_id, s.reward) for s in samples] == [("s0", 0.0), ("s1", 1.0), ("s2", 0.0)]
    # Dr. GRPO: r - mean; s0's advantage is now s2's, below the clean success
    assert [round(s.advantage, 4) for s in samples] == [-0.3333, 0.6667, -0.3333]
    assert samples[0].mask == [1, 1, 1, 1, 0, 1]  # its tokens still trained on, as a failure
    assert counts.per_trace_groups == 0  # zeroed trace rewards did not switch the grouping
    assert counts.rewards == [0.0, 1.0, 0.0]


def test_mask_zeroes_the_failed_span_and_keeps_the_reward():
    samples, _ = batch_of("mask")
    assert [(s.session_id, s.reward) for s in samples] == [("s0", 1.0), ("s1", 1.0), ("s2", 0.0)]
    assert samples[0].mask == [1, 1, 0, 0, 0, 1]  # response tokens [2, 4) out of the loss
    assert samples[0].behavior == [-0.5, -0.5, 0.0, 0.0, 0.0, -0.5]
    assert samples[1].mask == [1, 1, 1, 1, 0, 1]


def test_mask_without_a_span_masks_the_whole_trace():
    t = traj("s0", 1.0, [trace(0, 1.0, WHOLE), trace(1, 1.0)])
    masked = apply_rule(t, "mask")
    assert masked.traces[0].loss_mask == [0] * 6 and not masked.traces[0].trainable
    assert masked.traces[1] == t.traces[1] and masked.reward == 1.0
    only = traj("s0", 1.0, [trace(0, 1.0, WHOLE)])
    counts = GroupCounts()
    assert group_samples([only], 1, "grpo", "auto", counts, "mask") == []
    assert counts.empty == 1  # nothing left to train on: left out of the group


def test_zero_reward_per_trace_zeroes_only_the_failed_trace():
    t = traj("s0", 0.5, [trace(0, 1.0, SPAN), trace(1, 0.0)])
    out = apply_rule(t, "zero_reward", per_trace=True)
    assert [tr.reward for tr in out.traces] == [0.0, 0.0] and out.reward == 0.5
    whole = apply_rule(t, "zero_reward")  # the session's reward, and its copies
    assert whole.reward == 0.0 and [tr.reward for tr in whole.traces] == [0.0, 0.0]
    unscored = traj("s0", None, [trace(0, None, SPAN)], eval_status="error")
    assert apply_rule(unscored, "zero_reward").reward is None  # still left out as errored
    clean = traj("s1", 1.0, [trace(0, 1.0)])
    assert apply_rule(clean, "zero_reward") is clean and tool_failures(clean) == 0


def test_an_unknown_rule_is_an_error_and_the_config_defaults_to_zero_reward():
    with pytest.raises(ValueError, match="keep, zero_reward, mask"):
        apply_rule(traj("s0", 1.0, [trace(0, 1.0, SPAN)]), "drop")
    base = {"tasks": {"path": "t.jsonl"}, "model_dir": "m", "checkpoint_dir": "c"}
    assert parse_config(base).tool_parse_failures == "zero_reward"
    assert parse_config({**base, "tool_parse_failures": "mask"}).tool_parse_failures == "mask"
    with pytest.raises(ConfigError, match="tool_parse_failures"):
        parse_config({**base, "tool_parse_failures": "drop"})


@dataclass
class Member:  # what Group.trajectories reads
    trajectory: Trajectory


def group(*ts) -> Group:
    return Group("task", [Member(t) for t in ts], complete=True)  # type: ignore[arg-type]


def test_the_adapters_apply_the_rule_to_their_rows():
    g = group(traj("s0", 1.0, [trace(0, 1.0, SPAN)]), traj("s1", 1.0, [trace(0, 1.0)]))
    out = trl_batch([g], 2, pad_id=0)  # zero_reward by default
    assert out["polar_reward"] == [0.0, 1.0] and out["polar_tool_parse_failures"] == [1, 0]
    masked = trl_batch([g], 2, pad_id=0, tool_parse_failures="mask")
    assert masked["polar_reward"] == [1.0, 1.0]
    assert masked["env_mask"] == [[1, 1, 0, 0, 0, 1], [1, 1, 1, 1, 0, 1]]
    assert trl_batch([g], 2, pad_id=0, tool_parse_failures="keep")["polar_reward"] == [1.0, 1.0]
    t = g.trajectories[0]
    fields = sample_fields(t, 0, 0)
    assert fields["reward"] == 0.0 and fields["metadata"]["polar_tool_parse_failures"] == 1
    assert sample_fields(t, 0, 0, tool_parse_failures="keep")["reward"] == 1.0
    assert sample_fields(t, 0, 0, tool_parse_failures="mask")["loss_mask"] == [1, 1, 0, 0, 0, 1]


def test_collate_takes_the_rule_applied_to_the_trajectories_first():
    torch = pytest.importorskip("torch")
    members = [traj("s0", 1.0, [trace(0, 1.0, SPAN)]), traj("s1", 1.0, [trace(0, 1.0)])]
    zeroed = [tr for t in members for tr in apply_rule(t, "zero_reward").traces]
    assert torch.equal(collate(zeroed, 0, with_rewards=True)["rewards"], torch.tensor([0.0, 1.0]))
    masked = [tr for t in members for tr in apply_rule(t, "mask").traces]
    loss = collate(masked, 0)["loss_mask"]
    assert loss[0, 3:].tolist() == [1, 1, 0, 0, 0, 1] and loss[1, 3:].tolist()[2:4] == [1, 1]
