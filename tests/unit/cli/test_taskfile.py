import orjson
import pytest

from schemas import TaskAccepted, TaskRejected
from services.cli import taskfile


def test_yaml_becomes_json_and_json_goes_verbatim(tmp_path):
    y = tmp_path / "t.yaml"
    y.write_text("task_id: t1\ninstruction: hi\nnum_samples: 3\n")
    tf = taskfile.read_task_file(y)
    assert orjson.loads(tf.payload) == {"task_id": "t1", "instruction": "hi", "num_samples": 3}
    assert (tf.task_id, tf.num_samples) == ("t1", 3)
    j = tmp_path / "t.json"
    j.write_bytes(b'{"instruction":  "hi"}')
    tf = taskfile.read_task_file(j)
    assert tf.payload == b'{"instruction":  "hi"}' and tf.task_id is None and tf.num_samples == 1


def test_unparseable_json_still_goes_to_the_scheduler(tmp_path):
    j = tmp_path / "t.json"
    j.write_bytes(b"[1, 2")
    assert taskfile.read_task_file(j) == taskfile.TaskFile(b"[1, 2", None, None)


def test_bad_files_are_errors(tmp_path):
    with pytest.raises(taskfile.TaskFileError, match="cannot read"):
        taskfile.read_task_file(tmp_path / "missing.json")
    (tmp_path / "t.txt").write_text("{}")
    with pytest.raises(taskfile.TaskFileError, match=r"ends in \.json, \.yaml or \.yml"):
        taskfile.read_task_file(tmp_path / "t.txt")
    (tmp_path / "t.yml").write_text("a: [\n")
    with pytest.raises(taskfile.TaskFileError, match="not valid YAML"):
        taskfile.read_task_file(tmp_path / "t.yml")


def test_strict_check_names_the_unknown_field():
    assert taskfile.check_task(b'{"instruction": "hi"}') is None
    problem = taskfile.check_task(
        b'{"instruction": "hi", "agent": {"harness": "noop", "modle": "m"}}'
    )
    assert problem is not None and problem.field == "$.agent.modle"
    problem = taskfile.check_task(b'{"instruction": "hi", "num_samples": 0}')
    assert problem is not None and problem.field == "$.num_samples"


def test_answers_are_matched_to_our_task():
    payload = b'{"instruction": ""}'
    assert taskfile.is_ours_accepted(TaskAccepted(task_id="t1", session_ids=[]), "t1")
    assert not taskfile.is_ours_accepted(TaskAccepted(task_id="t2", session_ids=[]), "t1")
    named = TaskRejected(reason="r", payload="other", task_id="t1")
    assert taskfile.is_ours_rejected(named, "t1", payload)
    assert not taskfile.is_ours_rejected(named, "t9", payload)
    anonymous = TaskRejected(reason="r", payload=payload.decode())
    assert taskfile.is_ours_rejected(anonymous, "t9", payload)
    assert not taskfile.is_ours_rejected(anonymous, "t9", b'{"instruction": "x"}')


def test_new_task_ids_are_token_safe_and_distinct():
    ids = {taskfile.new_task_id() for _ in range(20)}
    assert len(ids) == 20
    assert all(
        taskfile.check_task(orjson.dumps({"instruction": "x", "task_id": i})) is None for i in ids
    )


def test_counts_in_lifecycle_order():
    counts = {"ERROR": 1, "REGISTERED": 2, "RUNNING": 0, "COMPLETED": 3, "ZZZ": 1}
    assert taskfile.ordered_counts(counts) == [
        ("REGISTERED", 2),
        ("COMPLETED", 3),
        ("ERROR", 1),
        ("ZZZ", 1),
    ]
    assert taskfile.finished(counts) == 4


def test_same_task_compares_specs_with_the_id_filled_in():
    from schemas import TaskRequest

    registered = TaskRequest(instruction="hi", task_id="t1", num_samples=2)
    assert taskfile.same_task(b'{"instruction": "hi", "num_samples": 2}', "t1", registered)
    assert not taskfile.same_task(b'{"instruction": "hi", "num_samples": 3}', "t1", registered)
    assert not taskfile.same_task(b"[", "t1", registered)
