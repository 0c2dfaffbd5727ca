"""The learning demo's task family: the split, questions, answers and templates."""

from collections import Counter

import msgspec

from schemas import TaskRequest
from services.demo import stars


def test_split_is_fixed_disjoint_and_covers_every_line():
    train, heldout = stars.split()
    assert (train, heldout) == stars.split()
    assert len(heldout) == stars.HELDOUT_SIZE == 108
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == sorted(stars.all_lines())
    assert len(stars.all_lines()) == 1024


def test_no_single_answer_is_right_on_more_than_a_seventh_of_the_heldout_set():
    _, heldout = stars.split()
    counts = Counter(stars.answer(line) for line in heldout)
    assert max(counts.values()) / len(heldout) < 0.14
    assert set(counts) == {str(c) for c in range(1, 10)}


def test_question_answer_and_line_of():
    q = stars.question("**.*..*.**")
    assert q == "How many * in **.*..*.**?"
    assert stars.answer("**.*..*.**") == "6"
    assert stars.line_of(q) == "**.*..*.**"
    assert stars.line_of("How many * in **?") is None


def test_training_templates_ask_distinct_training_lines_with_their_answers():
    train, heldout = set(stars.split()[0]), set(stars.split()[1])
    templates = stars.training_templates(seed=3, tasks=20, questions=32)
    assert templates == stars.training_templates(seed=3, tasks=20, questions=32)
    assert templates != stars.training_templates(seed=4, tasks=20, questions=32)
    counts = Counter()
    for t in templates:
        questions = t["instruction"].splitlines()
        lines = [stars.line_of(q) for q in questions]
        assert len(set(lines)) == 32 and set(lines) <= train and not set(lines) & heldout
        assert t["evaluator"]["config"]["answers"] == {
            q: str(line.count("*")) for q, line in zip(questions, lines, strict=True)
        }
        assert t["agent"]["env"]["QUIZ_TEMPERATURE"] == "1.0"
        counts.update(line.count("*") for line in lines)
        msgspec.convert({**t, "task_id": "x"}, TaskRequest)  # a valid task
    assert set(counts) == set(range(11))  # every count is asked, rare ones too


def test_heldout_templates_are_greedy_and_cover_the_heldout_set():
    templates = stars.heldout_templates(questions=36)
    assert len(templates) == 3
    lines = [stars.line_of(q) for t in templates for q in t["instruction"].splitlines()]
    assert sorted(lines) == stars.split()[1]
    assert {t["agent"]["env"]["QUIZ_TEMPERATURE"] for t in templates} == {"0.0"}
    assert "answers" not in templates[0]["instruction"]
    # held-out accuracy is exact: no near-miss credit in its scoring
    assert all("partial_credit" not in t["evaluator"]["config"] for t in templates)


def test_training_templates_carry_the_near_miss_credit_when_asked():
    credit = {"weight": 0.5, "window": 3}
    (t,) = stars.training_templates(seed=0, tasks=1, questions=4, partial_credit=credit)
    assert t["evaluator"]["config"]["partial_credit"] == credit
    (plain,) = stars.training_templates(seed=0, tasks=1, questions=4)
    assert "partial_credit" not in plain["evaluator"]["config"]
