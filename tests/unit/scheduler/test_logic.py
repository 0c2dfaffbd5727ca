import orjson
import pytest

from schemas import Session, SessionState, TaskRequest
from services.scheduler import logic

GOOD = {"task_id": "t1", "instruction": "fix it", "num_samples": 2, "agent": {"command": "true"}}


def with_(**kw):
    return orjson.dumps({**GOOD, **kw})


def deep(path: str, value):
    obj = orjson.loads(orjson.dumps(GOOD))
    cur = obj
    *parents, leaf = path.split(".")
    for p in parents:
        cur = cur.setdefault(p, {})
    cur[leaf] = value
    return orjson.dumps(obj)


BAD = [
    (b"", "not valid JSON"),
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe\x00", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'"a string"', "must be a JSON object"),
    (b"null", "must be a JSON object"),
    (orjson.dumps({"num_samples": 2}), "missing required field `instruction`"),
    (with_(instruction=""), "`instruction` must not be empty"),
    (with_(instruction=5), "Expected `str`, got `int` - at `$.instruction`"),
    (with_(num_samples=0), "`$.num_samples`"),
    (with_(num_samples=-3), "`$.num_samples`"),
    (with_(num_samples=10**6), "`$.num_samples`"),
    (with_(num_samples="4"), "Expected `int`, got `str`"),
    (with_(num_samples=2.5), "Expected `int`, got `float`"),
    (with_(timeout_seconds=0), "`$.timeout_seconds`"),
    (with_(timeout_seconds=-1), "`$.timeout_seconds`"),
    (with_(agent_timeout_seconds=100, timeout_seconds=10), "exceeds `timeout_seconds`"),
    (with_(task_id="has space"), "`$.task_id`"),
    (with_(task_id="a.b"), "`$.task_id`"),
    (with_(task_id="x" * 65), "`$.task_id`"),
    (with_(priority=10**9), "`$.priority`"),
    (with_(early_stop=5), "`early_stop` exceeds `num_samples`"),
    (with_(callback_url="ftp://x"), "`$.callback_url`"),
    (deep("agent.harness", "nosuch"), "unknown harness 'nosuch'"),
    (
        deep("agent.harness", "no_such_module_xyz:Cls"),
        "module 'no_such_module_xyz' is not importable",
    ),
    (deep("builder.name", "magic"), "unknown builder 'magic'"),
    (deep("evaluator.name", "vibes"), "unknown evaluator 'vibes'"),
    (deep("agent.command", None), "the `shell` harness needs `agent.command`"),
    (deep("runtime.backend", "k8s"), "Invalid value 'k8s' - at `$.runtime.backend`"),
    (orjson.dumps({**GOOD, "runtime": {"backend": "docker"}}), "missing required field `image`"),
    (
        orjson.dumps(
            {**GOOD, "runtime": {"backend": "local", "prepare": [{"action": "teleport"}]}}
        ),
        "Invalid value 'teleport'",
    ),
    (
        orjson.dumps(
            {
                **GOOD,
                "runtime": {
                    "backend": "local",
                    "prepare": [{"action": "upload_file", "dest": "a"}],
                },
            }
        ),
        "exactly one of `content` or `src`",
    ),
    (
        orjson.dumps({**GOOD, "runtime": {"backend": "local", "resources": {"cpus": -1}}}),
        "`$.runtime.resources.cpus`",
    ),
    (orjson.dumps({**GOOD, "metadata": []}), "Expected `object`, got `array` - at `$.metadata`"),
    (b"{" + b'"instruction": "' + b"x" * 600_000 + b'"}', "the limit is"),
]


@pytest.mark.parametrize(("raw", "expected"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_submission_is_rejected_with_reason(raw, expected):
    out = logic.parse_submission(raw, max_bytes=512 * 1024)
    assert isinstance(out, logic.Rejection), out
    assert expected in out.reason


def test_at_least_20_distinct_reasons():
    reasons = {logic.parse_submission(raw, max_bytes=512 * 1024).reason for raw, _ in BAD}
    assert len(reasons) >= 20


def test_field_is_named():
    out = logic.parse_submission(with_(num_samples=0), max_bytes=10_000)
    assert out.field == "$.num_samples" and out.task_id == "t1"
    out = logic.parse_submission(deep("agent.harness", "nosuch"), max_bytes=10_000)
    assert out.field == "$.agent.harness"


def test_unknown_task_keys_are_rejected_on_every_path_naming_each():
    # issue 17.6: a misspelt builder/evaluator key ran the defaults (every session scored 1)
    obj = {**GOOD, "builder": {"strategy": "per_request"}, "evaluator": {"nmae": "command"}}
    out = logic.parse_submission(orjson.dumps(obj), max_bytes=10_000)  # the bus path
    assert isinstance(out, logic.Rejection)
    assert out.field == "$.builder.strategy"
    assert "`$.builder.strategy`" in out.reason and "`$.evaluator.nmae`" in out.reason
    out = logic.parse_submission(with_(future_field=1), max_bytes=10_000)
    assert isinstance(out, logic.Rejection) and out.field == "$.future_field"
    # free-form maps stay free-form
    ok = deep("evaluator.config", {"anything": 1})
    assert isinstance(logic.parse_submission(ok, max_bytes=10_000), TaskRequest)


def test_custom_plugin_by_module_path_is_accepted():
    # by name: its module is found (services/scheduler/plugincheck.py loads it further)
    raw = deep("evaluator.name", "tests.unit.evaluators.plugins:Jitter")
    assert isinstance(logic.parse_submission(raw, max_bytes=10_000), TaskRequest)


def test_task_id_assignment():
    task = logic.parse_submission(orjson.dumps({"instruction": "x"}), max_bytes=1000)
    assert logic.with_task_id(task, "msg-1").task_id == "msg-1"
    assert logic.with_task_id(task, "bad id!").task_id.startswith("t-")
    assert logic.with_task_id(task).task_id != logic.with_task_id(task).task_id


def _s(i, state, reward=None, reason=None):
    return Session(
        session_id=f"t-{i:04d}",
        task_id="t",
        index=i,
        token="x",
        state=state,
        reward=reward,
        reason=reason,
    )


def test_finished_and_result():
    task = TaskRequest(task_id="t", instruction="x", num_samples=3)
    assert not logic.is_finished({"COMPLETED": 2, "RUNNING": 1}, 3)
    assert logic.is_finished({"COMPLETED": 2, "ERROR": 1}, 3)
    r = logic.build_result(
        task,
        [
            _s(1, SessionState.ERROR),
            _s(0, SessionState.COMPLETED, 1.0),
            _s(2, SessionState.COMPLETED, 0.0),
        ],
        submitted_at=1,
        now=2,
    )
    assert [x.session_id for x in r.sessions] == ["t-0000", "t-0001", "t-0002"]
    assert r.status == "completed" and r.mean_reward == 0.5
    assert r.counts == {"COMPLETED": 2, "ERROR": 1}
    r = logic.build_result(
        task, [_s(i, SessionState.CANCELLED) for i in range(3)], submitted_at=1, now=2
    )
    assert r.status == "cancelled"
    early = [
        _s(0, SessionState.COMPLETED, 1.0),
        _s(1, SessionState.CANCELLED, reason="early stop: x"),
    ]
    assert logic.build_result(task, early, submitted_at=1, now=2).status == "early_stopped"
    # every session ended ERROR (or TIMEOUT): failed, not "completed" (issue 38.11)
    failed = [_s(0, SessionState.ERROR, 0.0), _s(1, SessionState.TIMEOUT, 0.0),
              _s(2, SessionState.CANCELLED)]  # fmt: skip
    assert logic.build_result(task, failed, submitted_at=1, now=2).status == "failed"
    assert logic.should_early_stop({"COMPLETED": 2}, 2) and not logic.should_early_stop(
        {"COMPLETED": 2}, None
    )


def test_only_a_task_with_waiting_sessions_past_its_deadline_is_scanned():
    spec = TaskRequest(task_id="t", instruction="x", num_samples=3, timeout_seconds=60)
    waiting = {"REGISTERED": 1, "RUNNING": 2}
    assert not logic.may_have_overdue(1000.0, spec, waiting, now=1030.0)  # not due yet
    assert logic.may_have_overdue(1000.0, spec, waiting, now=1061.0)
    assert logic.may_have_overdue(1000.0, spec, {"READY": 1}, now=1061.0)
    # nobody waiting (running, ending or ended sessions are not the scheduler's to end)
    assert not logic.may_have_overdue(1000.0, spec, {"RUNNING": 2, "COMPLETED": 1}, now=9e9)
