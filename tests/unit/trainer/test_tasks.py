import json

import pytest

from services.trainer.config import ConfigError, TaskSourceConfig
from services.trainer.tasks import TaskSource, deep_merge, make_task, split, task_id

TEMPLATE = {"instruction": "x", "agent": {"harness": "noop"}}


def templates(n):
    return [{**TEMPLATE, "instruction": f"q{i}"} for i in range(n)]


def gen(n: int):  # a module:function task generator
    return templates(n)


def test_the_split_is_fixed_by_the_seed_and_disjoint():
    items = templates(10)
    train, held = split(items, 3, seed=7)
    assert (train, held) == split(items, 3, seed=7) and len(held) == 3
    assert {t["instruction"] for t in train}.isdisjoint(t["instruction"] for t in held)
    with pytest.raises(ConfigError, match="leaves no training"):
        split(items, 10, seed=0)


def test_training_order_is_deterministic_and_covers_each_epoch(tmp_path):
    src = TaskSource(templates(5), [], seed=1)
    epoch = [src.train_task(i)["instruction"] for i in range(5)]
    assert sorted(epoch) == [f"q{i}" for i in range(5)]
    again = TaskSource(templates(5), [], seed=1)
    assert [again.train_task(i)["instruction"] for i in range(10)] == [
        src.train_task(i)["instruction"] for i in range(10)
    ]


def test_jsonl_and_generator_sources(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(t) + "\n" for t in templates(4)))
    src = TaskSource.load(TaskSourceConfig(path=str(p), heldout=1), seed=0)
    assert len(src.train) == 3 and len(src.heldout) == 1
    src = TaskSource.load(
        TaskSourceConfig(generator=f"{__name__}:gen", args={"n": 6}, heldout=2), seed=0
    )
    assert len(src.train) == 4 and len(src.heldout) == 2


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"generator": "nope.module:gen"}, "cannot be loaded"),
        ({"generator": "no_colon"}, "module:function"),
    ],
)
def test_bad_generators_say_how_to_fix_them(cfg, match):
    with pytest.raises(ConfigError, match=match):
        TaskSource.load(TaskSourceConfig(**cfg), seed=0)


def test_a_template_that_is_not_a_task_fails_at_start(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"instruction": "x", "num_samples": 0}) + "\n")
    with pytest.raises(ConfigError, match="training template 0: not a valid task"):
        TaskSource.load(TaskSourceConfig(path=str(p)), seed=0)
    p.write_text("not json\n")
    with pytest.raises(ConfigError, match=":1: not JSON"):
        TaskSource.load(TaskSourceConfig(path=str(p)), seed=0)


def test_make_task_sets_id_samples_and_merges_overrides():
    t = {**TEMPLATE, "agent": {"harness": "shell", "command": "a", "env": {"A": "1"}}}
    task = make_task(
        t, task_id("r", "eval", 4, 2), 1, {"split": "heldout"}, {"agent": {"env": {"T": "0"}}}
    )
    assert task["task_id"] == "r-e4-2" and task["num_samples"] == 1
    assert task["agent"]["env"] == {"A": "1", "T": "0"} and task["agent"]["command"] == "a"
    assert task["metadata"] == {"split": "heldout"}
    assert t["agent"]["env"] == {"A": "1"}  # the template is not modified
    assert task_id("r", "train", 0, 7) == "r-t7"
    assert deep_merge({"a": {"b": 1}}, {"a": 2}) == {"a": 2}
