"""The dashboard's session index: filters, pages, live events, rates."""

import re

import pytest

from schemas import Outcome, Session, SessionState, SessionStateChanged
from services.dashboard.index import BadQuery, Filters, SessionIndex, parse_query

S = SessionState


def session(task: str, i: int, state=S.COMPLETED, reward=None, version=8, **kw) -> Session:
    return Session(
        session_id=f"{task}-{i:04d}",
        task_id=task,
        index=i,
        token="ps_x",
        state=state,
        version=version,
        reward=reward,
        **kw,
    )


def event(sid: str, to: S, version: int, ts: float, **kw) -> SessionStateChanged:
    return SessionStateChanged(
        session_id=sid,
        task_id=sid.rsplit("-", 1)[0],
        from_state=None,
        to_state=to,
        version=version,
        ts=ts,
        **kw,
    )


def index_of(n_tasks=3, per=4) -> SessionIndex:
    idx = SessionIndex()
    for t in range(n_tasks):
        task = f"t{t}"
        idx.add_task(task, "shell" if t % 2 == 0 else "codex", float(t))
        for i in range(per):
            idx.put(session(task, i, reward=float(i % 2), reason=f"r{i}" if i == 3 else None))
    return idx


def test_filters_combine_and_pages_count_every_match():
    idx = index_of()
    page = idx.query(Filters(harness="shell", reward_min=1.0), offset=0, limit=3)
    assert page.total == 4  # t0 and t2, indices 1 and 3
    assert [r.session_id for r in page.rows] == ["t0-0001", "t0-0003", "t2-0001"]
    assert (
        idx.query(Filters(harness="shell", reward_min=1.0), offset=3, limit=3).rows[0].session_id
        == "t2-0003"
    )
    assert idx.query(Filters(task="t1", reason="R3")).total == 1  # any case
    assert idx.query(Filters(task="nope")).total == 0


def test_events_move_rows_and_fill_the_timeline_even_when_replayed_late():
    idx = SessionIndex()
    idx.add_task("t", "shell", 0.0)
    idx.put(session("t", 0, state=S.RUNNING, version=3))
    v = idx.version
    assert idx.apply(event("t-0000", S.POSTRUN, 4, 10.0, node="n1"))
    assert idx.rows["t-0000"].state == "POSTRUN" and idx.rows["t-0000"].node == "n1"
    assert not idx.apply(event("t-0000", S.RUNNING, 3, 5.0))  # older: state kept...
    assert idx.rows["t-0000"].state == "POSTRUN"
    assert idx.rows["t-0000"].entered == {"POSTRUN": 10.0, "RUNNING": 5.0}  # ...time kept
    assert idx.version > v
    # an older registry read never undoes what a newer event said
    idx.put(session("t", 0, state=S.RUNNING, version=3))
    assert idx.rows["t-0000"].state == "POSTRUN"


def test_event_for_an_unknown_session_adds_it_and_terminal_ones_count_as_rate():
    idx = SessionIndex(window_seconds=10)
    assert idx.apply(event("u-0001", S.ERROR, 5, 100.0, reason="harness crashed\ntrace"))
    assert idx.tasks == {"u": ["u-0001"]}
    assert idx.sessions_per_second(105.0) == pytest.approx(0.1)
    assert idx.sessions_per_second(200.0) == 0.0
    assert idx.errors_by_reason() == [("ERROR: harness crashed", 1)]


def test_sort_by_reward_puts_unscored_last():
    idx = SessionIndex()
    idx.add_task("t", None, 0)
    for i, r in enumerate([0.5, None, 1.0]):
        idx.put(session("t", i, reward=r, outcome=Outcome.COMPLETED))
    assert [r.reward for r in idx.query(Filters(), sort="reward").rows] == [1.0, 0.5, None]


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"state": "running,NOPE"}, "unknown state(s) ['NOPE']"),
        ({"reward_min": "high"}, "reward_min must be a number"),
        ({"limit": "5000"}, "limit must be between 1 and 200"),
        ({"offset": "-1"}, "offset must be between"),
        ({"sort": "chaos"}, "sort must be one of"),
    ],
)
def test_bad_queries_say_what_is_wrong(query, message):
    with pytest.raises(BadQuery, match=re.escape(message)):
        parse_query(query)


def test_query_parsing():
    f, offset, limit, sort = parse_query(
        {"state": "running, error", "reward_max": "0", "limit": "10"}
    )
    assert f.states == {"RUNNING", "ERROR"} and f.reward_max == 0.0
    assert (offset, limit, sort) == (0, 10, "task")


def test_a_task_settles_only_once_the_final_records_are_read():
    """Under load the events said COMPLETED before the registry re-read brought the rewards:
    the task page settled on the event and showed "–" for good."""
    from services.dashboard.views import task_summary

    idx = SessionIndex()
    idx.add_task("t", "shell", 0.0)
    for i in range(2):
        idx.put(session("t", i, state=S.EVALUATING, version=6))
    for i in range(2):
        idx.apply(event(f"t-{i:04d}", S.COMPLETED, 7, 10.0 + i))
    summary = task_summary("t", idx.task_rows("t"), 0.0)
    assert summary["live"] is False and summary["settled"] is False
    idx.put(session("t", 0, reward=1.0, version=7))
    assert task_summary("t", idx.task_rows("t"), 0.0)["settled"] is False  # one still unread
    idx.put(session("t", 1, reward=0.0, version=7))
    summary = task_summary("t", idx.task_rows("t"), 0.0)
    assert summary["settled"] is True and summary["reward_mean"] == 0.5
    idx.apply(event("t-0000", S.COMPLETED, 7, 10.0))  # a replayed event changes nothing
    assert task_summary("t", idx.task_rows("t"), 0.0)["settled"] is True


def test_a_failed_session_is_listed_with_its_runs_cause_not_the_reward_rule():
    """Issue 38.10: every failed session was listed as `session ended error: reward 0 by
    rule` (the evaluator's reason won over the run's); the harness's error was nowhere."""
    from services.dashboard.index import cause
    from services.dashboard.views import sessions_page

    idx = SessionIndex()
    idx.add_task("t", "shell", 0.0)
    why = "shell exited with code 127: sh: 1: ./agent.sh: not found"
    rule = "session ended error: reward 0 by rule"
    idx.put(session("t", 0, state=S.ERROR, reward=0.0, reason=why, eval_reason=rule))
    idx.put(session("t", 1, reward=1.0, eval_reason="tests passed"))
    row = idx.rows["t-0000"]
    assert cause(row) == why
    # the run's exit code and stderr's end, from its artifacts; kept over a re-read
    idx.note_run("t-0000", 127, "boom\nsh: 1: ./agent.sh: not found")
    idx.put(session("t", 0, state=S.ERROR, reward=0.0, reason=why, eval_reason=rule))
    assert (row := idx.rows["t-0000"]).exit_code == 127
    assert row.stderr == "boom\nsh: 1: ./agent.sh: not found"
    assert cause(row) == why  # its reason holds both already
    timed_out = session("t", 2, state=S.TIMEOUT, reason="deadline passed", eval_reason=rule)
    idx.put(timed_out)
    idx.note_run("t-0002", 137, "Killed")
    assert cause(idx.rows["t-0002"]) == "deadline passed · exit code 137 · stderr: Killed"
    page = sessions_page(idx.query(Filters(task="t")))
    assert [r["cause"] for r in page["rows"]] == [
        why,
        "tests passed",  # an evaluated run: the evaluator's reason
        "deadline passed · exit code 137 · stderr: Killed",
    ]
    assert page["total"] == 3 and page["rows"][0]["exit_code"] == 127


def test_terminal_escapes_and_progress_bars_are_shown_as_the_terminal_left_them():
    from services.dashboard.index import last_lines, plain

    raw = (
        "\x1b[1;31merror\x1b[0m: \x1b]8;;http://x\x07link\x1b]8;;\x07 done\n10%\r50%\r100%\r\nok\n"
    )
    assert plain(raw) == "error: link done\n100%\nok\n"
    assert last_lines("a\n\nb\nc\nd\n", 2) == "c\nd"
    assert last_lines("x" * 50, width=10) == "…" + "x" * 9
