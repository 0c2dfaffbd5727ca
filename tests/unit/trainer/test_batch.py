import msgspec
import pytest

from schemas import Trajectory
from schemas.session import Outcome
from schemas.trajectory import Trace
from services.trainer.batch import GroupCounts, group_samples, per_trace


def trace(i: int, reward=None, *, mask=(1, 1), side_call=None, trainable=True, versions=("0",)):
    return Trace(
        trace_id=f"x/{i}",
        chain_id=i,
        prompt_ids=[1, 2, 3],
        response_ids=[10 + i, 11 + i],
        loss_mask=list(mask),
        response_logprobs=[(-0.5 if m else None) for m in mask],
        reward=reward,
        weight_versions=list(versions),
        side_call=side_call,
        trainable=trainable,
    )


def traj(sid: str, reward, traces, *, eval_status="ok", **meta):
    return Trajectory(
        session_id=sid,
        task_id="task",
        outcome=Outcome.COMPLETED,
        builder="prefix_merging",
        traces=traces,
        reward=reward,
        eval_status=eval_status,
        metadata={"num_samples": 4, **meta},
    )


def test_session_mode_gives_every_trace_its_sessions_advantage():
    members = [
        traj("a", 1.0, [trace(0, 1.0), trace(1, 1.0)]),
        traj("b", 0.0, [trace(0, 0.0)]),
    ]
    counts = GroupCounts()
    samples = group_samples(members, 2, "dr_grpo", "auto", counts)
    assert [(s.session_id, s.trace_index, s.advantage) for s in samples] == [
        ("a", 0, 0.5),
        ("a", 1, 0.5),
        ("b", 0, -0.5),
    ]
    assert counts.per_trace_groups == 0 and counts.groups == 1 and counts.members == 2


def test_samples_carry_tokens_mask_and_behavior_logprobs():
    (s,) = group_samples(
        [traj("a", 1.0, [trace(0, 1.0, mask=(1, 0))])], 1, "grpo", "auto", GroupCounts()
    )
    assert s.tokens == [1, 2, 3, 10, 11] and s.prompt_len == 3
    assert s.mask == [1, 0] and s.behavior == [-0.5, 0.0] and s.versions == ("0",)


def test_per_trace_rewards_group_by_trace_index_across_sessions():
    members = [
        traj("a", 0.5, [trace(0, 1.0), trace(1, 0.0)]),
        traj("b", 0.5, [trace(0, 0.0), trace(1, 1.0)]),
    ]
    assert per_trace(members, "auto")  # trace rewards differ from the session's
    counts = GroupCounts()
    samples = group_samples(members, 2, "dr_grpo", "auto", counts)
    got = {(s.session_id, s.trace_index): s.advantage for s in samples}
    assert got == {("a", 0): 0.5, ("b", 0): -0.5, ("a", 1): -0.5, ("b", 1): 0.5}
    assert counts.per_trace_groups == 1


def test_per_trace_by_flag_and_forced_session_mode():
    members = [traj("a", 1.0, [trace(0, 1.0)], per_trace_rewards=True)]
    assert per_trace(members, "auto") and not per_trace(members, "session")
    assert per_trace([traj("a", 1.0, [trace(0, 1.0)])], "trace")
    assert not per_trace([traj("a", 1.0, [trace(0, 1.0)])], "auto")


def test_errored_empty_and_missing_members_are_counted_and_left_out():
    members = [
        traj("ok1", 1.0, [trace(0, 1.0)]),
        traj("ok2", 0.0, [trace(0, 0.0)]),
        traj("err", None, [trace(0)], eval_status="error"),
        traj("empty", 0.0, [trace(0, 0.0, mask=(0, 0))]),
        traj("side", 1.0, [trace(0, 1.0, side_call="title")]),
    ]
    counts = GroupCounts()
    samples = group_samples(members, 6, "dr_grpo", "auto", counts)
    # only ok1 and ok2 are compared: the mean is 0.5, not dragged by the others
    assert sorted((s.session_id, s.advantage) for s in samples) == [("ok1", 0.5), ("ok2", -0.5)]
    assert (counts.errored, counts.empty, counts.missing, counts.members) == (1, 2, 1, 5)
    assert counts.rewards == [1.0, 0.0]


def test_a_group_left_with_one_member_is_degenerate_with_zero_advantage():
    members = [traj("a", 1.0, [trace(0, 1.0)]), traj("b", None, [trace(0)], eval_status="error")]
    counts = GroupCounts()
    (s,) = group_samples(members, 2, "grpo", "auto", counts)
    assert s.advantage == 0.0 and counts.degenerate == 1


def test_untrainable_traces_are_not_samples():
    members = [traj("a", 1.0, [trace(0, 1.0, trainable=False), trace(1, 1.0)])]
    samples = group_samples(members, 1, "grpo", "auto", GroupCounts())
    assert [s.trace_index for s in samples] == [0]  # index among trainable traces
    assert samples[0].tokens[-2:] == [11, 12]


@pytest.mark.parametrize("objective", ["grpo", "rloo", "dr_grpo"])
def test_equal_rewards_count_as_zero_variance(objective):
    members = [traj("a", 1.0, [trace(0, 1.0)]), traj("b", 1.0, [trace(0, 1.0)])]
    counts = GroupCounts()
    samples = group_samples(members, 2, objective, "auto", counts)
    assert all(s.advantage == 0.0 for s in samples) and counts.zero_variance == 1


def asked(i: int, question: int, reward: float) -> Trace:
    """Trace ``i`` of a session, answering ``question`` (its prompt ids say which)."""
    return msgspec.structs.replace(trace(i, reward), prompt_ids=[1, 2, 100 + question])


def test_prompt_grouping_compares_traces_that_saw_the_same_prompt():
    # two sessions ask questions 0 and 1 concurrently: their traces come in either order
    members = [
        traj("a", 0.5, [asked(0, 0, 1.0), asked(1, 1, 0.0)]),
        traj("b", 0.5, [asked(0, 1, 1.0), asked(1, 0, 0.0)]),
    ]
    counts = GroupCounts()
    samples = group_samples(members, 2, "dr_grpo", "prompt", counts)
    got = {(s.session_id, s.tokens[2], s.advantage) for s in samples}
    # question 0: a right (1.0), b wrong (0.0); question 1: b right, a wrong
    assert got == {("a", 100, 0.5), ("b", 100, -0.5), ("b", 101, 0.5), ("a", 101, -0.5)}
    assert counts.per_trace_groups == 1 and counts.zero_variance == 0
    # by trace index the same members compare different questions: all-equal pairs
    by_index = group_samples(members, 2, "dr_grpo", "trace", GroupCounts())
    assert {s.advantage for s in by_index} == {0.0}
