import pytest

from services.trainer.checkpoint import TrainerState
from services.trainer.cli import done_line
from services.trainer.config import ConfigError, load_config, parse_config

BASE = {"tasks": {"path": "t.jsonl"}, "model_dir": "m", "checkpoint_dir": "c"}


def test_yaml_config_with_defaults(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("tasks: {path: t.jsonl, heldout: 3}\nmodel_dir: m\ncheckpoint_dir: c\nlr: 0.001\n")
    cfg = load_config(p)
    assert cfg.lr == 0.001 and cfg.objective == "grpo" and cfg.rollout_ahead == 0
    assert cfg.kl_coef == 0.0 and cfg.mismatch_threshold == 1e-4
    assert str(cfg.log_file) == "c/log.jsonl" and cfg.eps_high == cfg.clip_eps


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"lrr": 1}, "lrr"),
        ({"objective": "ppo"}, "objective"),
        ({"stale_policy": "ignore"}, "stale_policy"),
        ({"tasks": {"path": "a", "generator": "m:f"}}, "exactly one"),
        ({"tasks": {}}, "exactly one"),
    ],
)
def test_bad_configs_name_the_problem(over, match):
    with pytest.raises(ConfigError, match=match):
        parse_config({**BASE, **over})


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_exponent_floats_in_yaml_and_json(tmp_path):
    # YAML 1.1 reads 1e-4 as a string; JSON writes 1e-12 that way
    y = tmp_path / "c.yaml"
    y.write_text("tasks: {path: t}\nmodel_dir: m\ncheckpoint_dir: c\nmismatch_threshold: 1e-6\n")
    assert load_config(y).mismatch_threshold == 1e-6
    j = tmp_path / "c.json"
    j.write_text('{"tasks": {"path": "t"}, "model_dir": "m", "checkpoint_dir": "c", "lr": 1e-12}')
    assert load_config(j).lr == 1e-12
    j.write_text('{"tasks": {"path": "t"}, "model_dir": "m", "checkpoint_dir": "c", "lr": "x"}')
    with pytest.raises(ConfigError, match="lr"):
        load_config(j)


def test_the_done_line_names_the_best_checkpoint_when_one_is_kept():
    state = TrainerState(run_id="r", step=9, best_step=4, best_accuracy=0.75)
    line = done_line(state, parse_config(BASE))
    assert line.startswith("done: 9 steps; log c/log.jsonl")
    assert line.endswith("; best held-out 0.750 at step 4: c/step-000004")
    assert "best" not in done_line(TrainerState(run_id="r", step=9), parse_config(BASE))
    assert "best" not in done_line(state, parse_config({**BASE, "keep_best": False}))
