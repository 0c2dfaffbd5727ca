"""The demo's task-family interface: loading a user's own family (a file or module:Class),
its templates, its reward (exact for unordered answers), its warm start, and the demo's
trainer config running it in the trainer's own process (issue 38.5)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from infra.topology import parse_topology
from schemas import TaskRequest
from services.demo import family as families
from services.demo import stars
from services.demo.family import FamilyError, Item, load_family, reward_credit
from services.demo.run import Recipe, trainer_config
from services.demo.topology import stack_topology

REPO = Path(__file__).resolve().parents[3]
QUIZ = REPO / "examples" / "own_task" / "family.py"  # the example family: ten digit classes


def test_a_family_loads_by_name_file_or_module_class():
    assert isinstance(load_family("stars"), stars.Stars)
    by_file = load_family(str(QUIZ))
    assert by_file.name == "most_common_digit" and not by_file.ordered
    assert load_family(f"{QUIZ}:MostCommonDigit").name == "most_common_digit"
    assert load_family("examples.own_task.family:MostCommonDigit").name == "most_common_digit"


def test_a_family_that_cannot_be_used_is_refused_saying_why(tmp_path):
    with pytest.raises(FamilyError, match="no file"):
        load_family(str(tmp_path / "missing.py"))
    with pytest.raises(FamilyError, match="cannot import"):
        load_family("no_such_module:Family")
    with pytest.raises(FamilyError, match="not a TaskFamily"):
        load_family("services.demo.stars:split")
    two = tmp_path / "two.py"
    two.write_text(
        "from services.demo.family import TaskFamily\n"
        "class A(TaskFamily): pass\nclass B(TaskFamily): pass\n"
    )
    with pytest.raises(FamilyError, match="exactly one TaskFamily subclass"):
        load_family(str(two))
    bad = tmp_path / "bad.py"
    bad.write_text(
        textwrap.dedent(
            """
            from services.demo.family import Item, TaskFamily
            class Bad(TaskFamily):
                name = "bad"
                answers = ("yes", "no")
                def train(self): return [Item("Is it?", "maybe")]
                def heldout(self): return [Item("Was it?", "no")]
            """
        )
    )
    with pytest.raises(FamilyError, match="'maybe' of 'Is it\\?' is not in `answers`"):
        load_family(str(bad))


def test_the_shaped_reward_is_for_ordered_answers_only():
    credit = (0.5, 3)
    assert reward_credit(load_family("stars"), "auto", credit) == credit  # counts: ordered
    assert reward_credit(load_family("stars"), "exact", credit) is None
    digits = load_family(str(QUIZ))
    assert reward_credit(digits, "auto", credit) is None  # classes: exact
    with pytest.raises(FamilyError, match="assumes ordered numeric answers"):
        reward_credit(digits, "shaped", credit)


def test_a_users_family_makes_valid_templates_from_its_own_items():
    fam = load_family(str(QUIZ))
    train = {i.question: i.answer for i in fam.train()}
    held = {i.question for i in fam.heldout()}
    templates = families.training_templates(str(QUIZ), 1, tasks=5, questions=16)
    assert templates == families.training_templates(str(QUIZ), 1, tasks=5, questions=16)
    for t in templates:
        answers = t["evaluator"]["config"]["answers"]
        assert list(answers) == t["instruction"].splitlines() and len(answers) == 16
        assert all(train[q] == a for q, a in answers.items()) and not set(answers) & held
        assert "partial_credit" not in t["evaluator"]["config"]
        assert t["metadata"]["family"] == "most_common_digit"
        assert t["agent"]["env"]["QUIZ_MAX_TOKENS"] == "3"  # one digit, end of turn, spare
        msgspec.convert({**t, "task_id": "x"}, TaskRequest)
    heldout = families.heldout_templates(str(QUIZ), questions=36)
    asked = [q for t in heldout for q in t["instruction"].splitlines()]
    assert sorted(asked) == sorted(held)
    # the trainer's accuracy is the mean of the sessions' scores: sessions of one size
    # (120 = 4 x 30, not 36 + 36 + 36 + 12, which weighed the last 12 three times)
    assert [len(t["evaluator"]["config"]["answers"]) for t in heldout] == [30, 30, 30, 30]
    assert {t["agent"]["env"]["QUIZ_TEMPERATURE"] for t in heldout} == {"0.0"}


def test_stars_is_the_same_family_through_either_door():
    assert stars.training_templates(seed=3, tasks=4) == families.training_templates(
        "stars", 3, tasks=4
    )
    assert stars.heldout_templates() == families.heldout_templates("stars")
    # the training order no longer depends on the process's string hashing
    code = "from services.demo import stars; print(stars.training_templates(seed=2, tasks=2))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
        ).stdout
        for _ in range(2)
    }
    assert len(runs) == 1


def test_the_demo_trains_a_users_family_in_the_trainers_own_process(tmp_path):
    topo = parse_topology(stack_topology(tmp_path, tmp_path / "model"), "demo")
    recipe = Recipe(task=str(QUIZ.relative_to(REPO)), questions=8)
    cfg = trainer_config(recipe, topo, tmp_path, tmp_path / "model", 60.0)
    tasks = cfg["tasks"]
    assert tasks["args"]["family"] == str(QUIZ)  # absolute: the trainer may run elsewhere
    assert tasks["args"]["partial_credit"] is None  # unordered: the exact reward
    code = (
        "import json, sys; from services.trainer.tasks import call_generator; "
        "t = call_generator(sys.argv[1], json.loads(sys.argv[2])); print(json.dumps(t[0]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, tasks["generator"], json.dumps(tasks["args"])],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository: the file is found by its path
        check=True,
    )
    first = json.loads(done.stdout)
    assert first["metadata"]["family"] == "most_common_digit"
    assert len(first["instruction"].splitlines()) == 8
    held = [json.loads(line) for line in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert sum(len(t["evaluator"]["config"]["answers"]) for t in held) == 120
    stars_cfg = trainer_config(Recipe(), topo, tmp_path, tmp_path / "model", 60.0)
    assert stars_cfg["tasks"]["args"]["partial_credit"] == {"weight": 0.5, "window": 3}


def test_the_warm_start_targets_the_familys_answer_space(tmp_path):
    from services.demo.warmstart import create_model, greedy_accuracy, warm_start

    fam = load_family(str(QUIZ))
    base = create_model(tmp_path / "base", 0)
    ws = warm_start(base, tmp_path / "warm", seed=0, steps=25, batch=16, family=fam)
    items = fam.heldout()[::6]
    # it learned the form (a digit, then end of turn), nothing of the task: near chance
    assert greedy_accuracy(ws.model_dir, items, fam) <= 0.3
    said = _greedy_answers(ws.model_dir, items)
    assert set(said) <= set(fam.answers), said


def _greedy_answers(model_dir: Path, items: list[Item]) -> list[str]:
    import torch

    from services.common.tokenization.tokenizer import ChatTokenizer
    from services.demo.warmstart import Prompts
    from services.engine.weights import load_model

    model, prompts = load_model(model_dir), Prompts(ChatTokenizer.load(model_dir))
    out = []
    with torch.inference_mode():
        for item in items:
            chunk, cache, toks = prompts.prompt(item.question), model.new_cache(), []
            for _ in range(3):
                token = int(model.forward([chunk], [cache])[0].argmax())
                if token == prompts.end:
                    break
                toks.append(token)
                chunk = [token]
            out.append(prompts.tok.tokenizer.decode(toks))
    return out


def test_the_warm_start_cache_is_keyed_by_the_task():
    from services.demo.warmstart import DIMS
    from tests.bench.sim_stars import warm_key

    sft = (60, 32, 3e-3)
    a = warm_key(load_family("stars"), 0, DIMS, sft)
    b = warm_key(load_family(str(QUIZ)), 0, DIMS, sft)
    assert a != b and "stars" in a and "most_common_digit" in b
    assert a == warm_key(load_family("stars"), 0, DIMS, sft)


def test_a_family_without_its_items_is_refused_naming_what_it_lacks(tmp_path):
    from services.demo.family import FamilyError, load_family

    path = tmp_path / "half.py"
    path.write_text(
        "from services.demo.family import TaskFamily\n\n"
        "class Half(TaskFamily):\n    name = 'half'\n    answers = ('a', 'b')\n\n"
        "    def train(self):\n        return []\n"
    )
    with pytest.raises(FamilyError, match="Half does not define heldout"):
        load_family(f"{path}:Half")
