"""The builder service's decisions and trajectory assembly, without servers."""

import random

import msgspec
import pytest

from schemas import (
    Artifacts,
    BuilderSpec,
    Outcome,
    Session,
    SessionFinished,
    SessionState,
    subjects,
)
from services.builder import logic
from services.builder.integrity import assess
from services.builder.logic import Action
from services.builder.strategies import default_registry
from services.builder.strategies.base import full_calls
from tests.unit.builder.synth import EOT, Capture, agent_loop, glue_after, opening, text

HERE = "tests.unit.builder.custom_builders"
S = SessionState


def session(state: SessionState, attempt: int = 0) -> Session:
    return Session(
        session_id="t-0000", task_id="t", index=0, token="x", state=state, attempt=attempt
    )


def finished(outcome=Outcome.COMPLETED, attempt=0, **kw) -> SessionFinished:
    return SessionFinished(session_id="s-1", task_id="t", outcome=outcome, attempt=attempt, **kw)


@pytest.mark.parametrize(
    ("state", "action"),
    [
        (S.POSTRUN, Action.BEGIN),
        (S.BUILDING, Action.RESUME),
        (S.EVALUATING, Action.SKIP),
        (S.COMPLETED, Action.SKIP),
        (S.TIMEOUT, Action.SKIP),
        (S.CANCELLED, Action.SKIP),
        (S.ERROR, Action.SKIP),
        (S.RUNNING, Action.RETRY),
        (S.READY, Action.RETRY),
    ],
)
def test_decide_by_state(state, action):
    assert logic.decide(session(state), finished()).action == action


def test_decide_unknown_session_and_stale_attempt():
    assert logic.decide(None, finished()).action == Action.POISON
    d = logic.decide(session(S.POSTRUN, attempt=1), finished(attempt=0))
    assert d.action == Action.SKIP and "attempt 0" in d.reason


def test_names_are_per_attempt():
    assert subjects.trajectory_object("s", 2) == "trajectories/s/2"
    assert logic.built_msg_id("s", 2) == "built:s:2"


def loop_records(turns=5, seed=1):
    cap = Capture()
    agent_loop(cap, random.Random(seed), turns)
    return cap


def build(records, outcome=Outcome.COMPLETED, name="prefix_merging", config=None, **kw):
    spec = BuilderSpec(name=name, config=config or {})
    return logic.build_trajectory(finished(outcome, **kw), spec, records, default_registry())


def test_completed_session_trajectory():
    cap = loop_records()
    art = Artifacts(harness="codex", harness_version="0.1", protocol="openai_responses")
    tr = build(cap.records, artifacts=art)
    assert tr.intact and tr.builder == "prefix_merging" and tr.reward is None
    assert len(tr.traces) == 1 and tr.traces[0].trainable and tr.stats.completions == 5
    assert (tr.harness, tr.harness_version, tr.protocol) == ("codex", "0.1", "openai_responses")
    assert tr.metadata["reward_policy"] == "evaluate"
    assert tr.metadata["builder_notes"]["eot_token_id"] == EOT
    assert build(cap.records, artifacts=art) == tr  # deterministic: a rebuild is identical


def test_timed_out_intact_session_trains_with_reward_zero():
    cap = loop_records()
    p = opening(text(random.Random(0), 4), [9])
    cap.call(p, [], finish="abort", aborted=True)  # cut by the timeout: last call
    tr = build(cap.records, Outcome.TIMEOUT, reason="agent timeout")
    assert tr.intact and tr.reward == 0.0 and tr.metadata["reward_policy"] == "zero_reward"
    assert all(t.reward == 0.0 for t in tr.traces)
    assert tr.traces[0].trainable and sum(tr.traces[0].loss_mask) > 0
    assert tr.metadata["finish_reason"] == "agent timeout"


def test_errored_session_cut_mid_chain_is_fully_masked():
    cap, rng = Capture(), random.Random(3)
    p0 = opening(text(rng, 10), text(rng, 4))
    o0 = text(rng, 3)
    cap.call(p0, o0, finish="error", error="upstream 500")
    p1 = p0 + o0 + glue_after(o0, [5])
    cap.call(p1, [6, EOT], finish="stop")
    tr = build(cap.records, Outcome.ERROR)
    assert not tr.intact and tr.metadata["reward_policy"] == "masked"
    assert "seq 0 errored (upstream 500) mid-chain" in tr.metadata["integrity_problems"][0]
    assert len(tr.traces) == 2  # kept, never dropped...
    assert all(not t.trainable and not any(t.loss_mask) for t in tr.traces)  # ...but masked


def test_a_call_that_failed_before_sampling_is_no_lost_call_and_no_cut():
    cap, rng = Capture(), random.Random(5)
    p0 = opening(text(rng, 10), text(rng, 4))
    o0 = text(rng, 3) + [EOT]
    cap.call(p0, o0, finish="stop")
    cap.call([], [], finish="error", error="BackendError: prompt too long")  # void: seq 1
    p2 = p0 + o0 + glue_after(o0, [5])
    cap.call(p2, [6, EOT], finish="stop")
    assert [r.void for r in cap.records] == [False, True, False]
    calls = full_calls(cap.records)
    assert [c.seq for c in calls.calls] == [0, 2] and calls.void == [1]
    tr = build(cap.records)
    assert tr.intact and len(tr.traces) == 1  # one merged chain, the failure left out


def test_missing_or_unreconstructable_completions_make_it_not_intact():
    plain = Capture(delta=False)
    agent_loop(plain, random.Random(4), 4)
    gap = [r for r in plain.records if r.seq != 1]
    integrity = assess(full_calls(gap))
    assert integrity.problems == ("completions missing from the capture: seqs [1]",)
    delta = loop_records(4)
    broken = [r for r in delta.records if r.seq != 1]  # seq 2 and 3 build on seq 1
    problems = assess(full_calls(broken)).problems
    assert "base record missing): seqs [2, 3]" in problems[1]
    assert assess(full_calls(plain.records)).intact
    tr = build(gap)
    assert not tr.intact and tr.metadata["reward_policy"] == "evaluate"  # completed: kept


def test_a_retried_session_builds_only_its_finished_attempt():
    # Attempt 0 made two calls and died with its node (the second cut); attempt 1 ran the
    # same task again on the shared call counter (seqs 2 and 3) and completed.
    first = loop_records(2)
    first.records[-1] = msgspec.structs.replace(first.records[-1], aborted=True)
    again = loop_records(2)
    retried = [
        msgspec.structs.replace(
            r,
            seq=r.seq + 2,
            attempt=1,
            prompt_base_seq=(None if r.prompt_base_seq is None else r.prompt_base_seq + 2),
        )
        for r in again.records
    ]
    tr = build(first.records + retried, attempt=1)
    alone = build(again.records)
    # the dead attempt's tokens are in no trace: the same traces, their calls renumbered
    assert [t.completion_seqs for t in tr.traces] == [[2, 3]]
    assert tr.traces == [msgspec.structs.replace(t, completion_seqs=[2, 3]) for t in alone.traces]
    assert tr.intact  # its cut call is not this attempt's "cut mid-chain"
    assert tr.metadata["records"] == 2 and tr.metadata["earlier_attempt_records"] == 2
    # ...but a call number missing from any attempt is still a lost call
    gap = build(first.records[:1] + retried, attempt=1)
    assert gap.metadata["integrity_problems"] == ["completions missing from the capture: seqs [1]"]
    # unless it is below the attempt's floor: attempt 0, cut off mid-call, never recorded
    # its number 1 (the chaos test found such retried sessions not intact in a rehearsal)
    floored = build(first.records[:1] + retried, attempt=1, seq_floor=2)
    assert floored.intact and "integrity_problems" not in floored.metadata
    # a number of its own missing is still a lost call
    own_gap = build(first.records + retried[1:], attempt=1, seq_floor=2)
    assert own_gap.metadata["integrity_problems"][0] == (
        "completions missing from the capture: seqs [2]"
    )


def test_settling_waits_for_the_attempts_own_numbers_only():
    records = loop_records(2).records  # seqs 0 and 1
    assert logic.all_numbered_present(records, 2)
    assert not logic.all_numbered_present(records, 3)  # number 2 not recorded yet
    later = [msgspec.structs.replace(r, seq=r.seq + 3) for r in records]  # seqs 3 and 4
    assert not logic.all_numbered_present(later, 5)  # 0..2 missing
    assert logic.all_numbered_present(later, 5, floor=3)  # 0..2 were earlier attempts'
    assert not logic.all_numbered_present(later, 6, floor=3)


def test_failed_builder_falls_back_to_masked_per_request():
    cap = loop_records(3)
    tr = build(cap.records, name=f"{HERE}:Broken")
    assert not tr.intact and tr.builder == f"{HERE}:Broken"
    assert tr.metadata["build_error"] == "RuntimeError: this builder always fails"
    assert tr.metadata["fallback_builder"] == "per_request" and len(tr.traces) == 3
    assert all(not t.trainable and not any(t.loss_mask) for t in tr.traces)


def test_a_quarantined_session_is_built_by_the_fallback_without_its_builder():
    # issue 33: building it killed the builder again and again; its builder is not run
    cap = loop_records(3)
    spec = BuilderSpec(name=f"{HERE}:Broken")  # it would raise if it were run
    why = "quarantined: the builder's process died 4 times building it"
    tr = logic.build_trajectory(finished(), spec, cap.records, default_registry(), (), why)
    assert tr.metadata["build_error"] == why and not tr.intact
    assert tr.metadata["fallback_builder"] == "per_request" and len(tr.traces) == 3


@pytest.mark.parametrize(
    ("name", "config", "error"),
    [
        (f"{HERE}:BadShape", {}, "has 2 response tokens but 1 mask"),
        ("no_such:Builder", {}, "cannot import module 'no_such'"),
        ("prefix_merging", {"eot": 1}, "accepted keys: eot_token_id"),
    ],
)
def test_bad_builders_and_configs_are_recorded(name, config, error):
    tr = build(loop_records(2).records, name=name, config=config)
    assert error in tr.metadata["build_error"] and not tr.intact


def test_custom_builder_result_is_used():
    tr = build(loop_records(3).records, name=f"{HERE}:LastOnly")
    assert tr.intact and [t.trace_id for t in tr.traces] == ["s-1/last"]


def test_zero_records_build_an_empty_intact_trajectory():
    tr = build([], Outcome.TIMEOUT)
    assert tr.traces == [] and tr.intact and tr.stats.completions == 0 and tr.protocol is None
