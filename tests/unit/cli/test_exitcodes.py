"""``polar submit --wait``'s exit code: non-zero, with the reason, when no session completed."""

from schemas import SessionResult, SessionState, TaskResult
from services.cli import exitcodes
from tests.unit.cli.test_main import invoke

ST = SessionState


def result(*sessions: SessionResult) -> TaskResult:
    return TaskResult(
        task_id="t", status="completed", num_samples=len(sessions), sessions=list(sessions)
    )


def row(i: int, state: SessionState, reason: str | None = None, reward: float | None = None):
    return SessionResult(session_id=f"t-{i:04d}", state=state, reason=reason, reward=reward)


def test_one_completed_session_is_success_even_with_reward_0():
    done = result(row(0, ST.ERROR, "boom"), row(1, ST.COMPLETED, reward=0.0))
    assert exitcodes.verdict(done) == (exitcodes.OK, None)


def test_every_session_failing_for_one_reason_says_so():
    why = "claude_code exited with code 1: API Error: 529 no healthy worker"
    code, text = exitcodes.verdict(result(row(0, ST.ERROR, why), row(1, ST.ERROR, why)))
    assert code == exitcodes.NONE_COMPLETED == 3
    assert text == f"no session completed (2 ERROR); every one: {why}"


def test_mixed_endings_name_the_commonest_reason():
    code, text = exitcodes.verdict(
        result(
            row(0, ST.TIMEOUT, "agent timeout after 60s: process tree killed"),
            row(1, ST.ERROR, "deadline passed before the session ran"),
            row(2, ST.ERROR, "deadline passed before the session ran"),
            row(3, ST.CANCELLED),
        )
    )
    assert code == 3
    assert text == (
        "no session completed (1 CANCELLED, 2 ERROR, 1 TIMEOUT); "
        "2 of them: deadline passed before the session ran"
    )


def test_the_codes_are_in_submit_help():
    r = invoke("submit", "--help")
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert "Exit codes: 0 submitted" in text
    assert "3 (--wait) the task ended but no session completed" in text
