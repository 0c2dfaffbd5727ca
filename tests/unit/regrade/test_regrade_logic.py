"""``polar regrade``'s decisions without servers: what it takes, how it names itself, the
re-graded trajectory, and the command line's values."""

from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from evaluators import EvalResult
from schemas import EvaluatorSpec, SessionResult, SessionState
from services.cli.regrade import RegradeUsage, evaluator_spec, parse_when, replay_result
from services.regrade.logic import NewGrade, RegradeStats, Selection, regrade_id, regraded
from tests.unit.export.test_layouts import scored

OWN = EvaluatorSpec(name="test_on_output", config={"test_command": "pytest"})
NEW = EvaluatorSpec(name="exact_answer", config={"answers": {"q": "6"}})
T0 = datetime(2026, 12, 7, 12, tzinfo=UTC)


def test_a_regrade_keeps_the_tokens_and_carries_both_grades():
    t = scored(reward=1.0)
    again = regraded(t, OWN, NewGrade(NEW, EvalResult.ok(0.5, "half"), "artifacts"))
    assert [
        (x.prompt_ids, x.response_ids, x.loss_mask, x.response_logprobs) for x in again.traces
    ] == [(x.prompt_ids, x.response_ids, x.loss_mask, x.response_logprobs) for x in t.traces]
    assert again.reward == 0.5 and {x.reward for x in again.traces} == {0.5}
    own, new = again.grades
    assert (own.evaluator, own.reward, own.regrade_id, own.via) == (
        "test_on_output",
        1.0,
        None,
        "session",
    )
    assert (new.evaluator, new.reward, new.reason, new.via) == (
        "exact_answer",
        0.5,
        "half",
        "artifacts",
    )
    assert new.regrade_id == regrade_id(NEW) == again.metadata["regrade_id"]
    assert again.metadata["num_samples"] == 4 and again.metadata["sample_index"] == 2


def test_a_regrade_of_a_regrade_keeps_the_sessions_own_grade_first():
    once = regraded(scored(reward=1.0), OWN, NewGrade(NEW, EvalResult.ok(0.0), "artifacts"))
    third = EvaluatorSpec(name="session_completed")
    twice = regraded(once, OWN, NewGrade(third, EvalResult.ok(1.0), "replay", "r-0000"))
    assert [g.evaluator for g in twice.grades] == ["test_on_output", "session_completed"]
    assert twice.grades[1].replay_session == "r-0000"


def test_a_failed_evaluation_has_no_reward_and_says_why():
    again = regraded(scored(), OWN, NewGrade(NEW, EvalResult.error("no artifacts"), "artifacts"))
    assert again.reward is None and again.eval_status == "error"
    assert again.grades[1].status == "error" and again.grades[1].reason == "no artifacts"


def test_the_regrade_id_names_the_evaluator_and_its_config():
    assert regrade_id(NEW) == regrade_id(msgspec.structs.replace(NEW))
    other = msgspec.structs.replace(NEW, config={"answers": {"q": "7"}})
    assert regrade_id(other) != regrade_id(NEW)
    assert regrade_id(EvaluatorSpec(name="pkg.mod:Judge")).startswith("pkg-mod-judge-")


def test_the_selection_takes_named_sessions_or_tasks_in_the_window():
    t = scored()  # session s-0000 of task s
    assert Selection().takes(t)
    assert Selection(session_ids=frozenset({"s-0000"})).takes(t)
    assert Selection(task_ids=frozenset({"s"})).takes(t)
    assert not Selection(task_ids=frozenset({"other"})).takes(t)
    assert Selection(since=T0).takes(t, T0) and not Selection(since=T0).takes(t, T0 - timedelta(1))
    assert not Selection(until=T0).takes(t, T0)
    replay = msgspec.structs.replace(t, metadata={"replay_of": "s-0000"})
    assert not Selection().takes(replay)  # graded with its original, never on its own


def test_stats_count_changes_and_errors():
    stats, t = RegradeStats("x"), scored(reward=1.0)
    stats.count(
        t, regraded(t, OWN, NewGrade(NEW, EvalResult.ok(1.0), "artifacts")), EvalResult.ok(1.0)
    )
    bad = EvalResult.error("boom")
    stats.count(t, regraded(t, OWN, NewGrade(NEW, bad, "artifacts")), bad)
    assert (stats.graded, stats.changed, stats.errors) == (2, 1, ["s-0000: boom"])


def test_times_are_iso_or_ages():
    assert parse_when("24h", T0) == T0 - timedelta(hours=24)
    assert parse_when("90m", T0) == T0 - timedelta(minutes=90)
    assert parse_when("2026-12-01T10:00") == datetime(2026, 12, 1, 10, tzinfo=UTC)
    assert parse_when(None) is None
    with pytest.raises(RegradeUsage, match="neither an ISO 8601 time nor an age"):
        parse_when("yesterday")


def test_the_evaluator_comes_from_the_command_line_or_a_file(tmp_path):
    assert evaluator_spec("exact_answer", '{"answers": {"q": "6"}}', None) == NEW
    f = tmp_path / "eval.yaml"
    f.write_text("evaluator:\n  name: command\n  runtime: fresh\n  config: {command: echo 1}\n")
    spec = evaluator_spec(None, None, f)
    assert (spec.name, spec.runtime, spec.config) == ("command", "fresh", {"command": "echo 1"})
    with pytest.raises(RegradeUsage, match="--evaluator NAME or --evaluator-file"):
        evaluator_spec(None, None, None)
    with pytest.raises(RegradeUsage, match="not JSON"):
        evaluator_spec("command", "{nope", None)
    f.write_text("name: command\nruntime: sideways\n")
    with pytest.raises(RegradeUsage, match="not an evaluator spec"):
        evaluator_spec(None, None, f)


def test_a_replays_verdict():
    done = SessionResult(
        session_id="r-0000", state=SessionState.COMPLETED, reward=0.5, eval_reason="ok"
    )
    assert replay_result(done, None) == EvalResult.ok(0.5, "ok")
    assert (
        replay_result(done, "call 0: messages[0]").reason
        == "the replay diverged: call 0: messages[0]"
    )
    failed = SessionResult(session_id="r-0000", state=SessionState.ERROR, reason="sandbox died")
    assert replay_result(failed, None) == EvalResult.error("sandbox died")
