"""``max_seconds``: the run's last step is the one that ends past the time limit."""

import time

from services.trainer import checkpoint as ck
from services.trainer.config import parse_config
from services.trainer.loop import Trainer

BASE = {"tasks": {"path": "t.jsonl"}, "model_dir": "m", "checkpoint_dir": "c", "steps": 100}


def trainer(**over) -> Trainer:
    t = Trainer(parse_config({**BASE, **over}))
    t.state = ck.TrainerState(run_id="run")
    return t


def test_without_a_limit_only_the_step_count_ends_the_run():
    t = trainer()
    t.started -= 10_000
    assert not t._final()
    t.state.step = 100
    assert t._final()


def test_past_max_seconds_no_step_follows():
    t = trainer(max_seconds=30)
    t.state.step = 5
    assert not t._final()
    t.started = time.time() - 31
    assert t._final()
