"""The learning demo's default task family (``Stars``): "how many `*` in a 10-character
line of `*` and `.`".

All 1,024 lines split once, by a fixed seed, into a held-out set (``HELDOUT_SIZE`` lines,
never trained on) and the training lines. A task template asks ``questions`` distinct
lines, one question per line of its instruction (what ``infra/demo/quiz_agent.py`` asks,
one chat call each, so one trace each); the expected answers are in the evaluator's
config (``exact_answer``, one reward per trace), which the agent never sees. Pure
functions: no I/O, no clock.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from typing import Any

from services.demo import family
from services.demo.family import Item, TaskFamily

LENGTH = 10
# held-out lines per count: near-uniform, and most of counts 1 and 9 (10 lines each) left
# for training; counts 0 and 10 (one line each) are training-only
HELDOUT_PER_COUNT = {1: 4, 2: 14, 3: 14, 4: 15, 5: 14, 6: 15, 7: 14, 8: 14, 9: 4}
HELDOUT_SIZE = sum(HELDOUT_PER_COUNT.values())  # 108
SPLIT_SEED = 20261201
QUESTION = "How many * in {line}?"
_LINE = re.compile(rf"[*.]{{{LENGTH}}}")


def all_lines() -> list[str]:
    return ["".join(p) for p in itertools.product("*.", repeat=LENGTH)]


@functools.cache
def split() -> tuple[list[str], list[str]]:
    """(train, heldout), disjoint and the same on every machine. The held-out set is
    ``HELDOUT_PER_COUNT``, so no single answer is right on more than 15 of its 108 lines
    (a model that always says "5" scores 0.13, not the 0.25 that count has among all
    lines); the training set is everything else."""
    rng = random.Random(SPLIT_SEED)
    heldout: list[str] = []
    for count, n in HELDOUT_PER_COUNT.items():
        heldout += rng.sample([x for x in all_lines() if x.count("*") == count], n)
    held = set(heldout)
    return [x for x in all_lines() if x not in held], sorted(heldout)


def question(line: str) -> str:
    return QUESTION.format(line=line)


def answer(line: str) -> str:
    return str(line.count("*"))


def line_of(text: str) -> str | None:
    """The pattern a question asks about, or None when it names none."""
    found = _LINE.search(text)
    return found.group(0) if found else None


def training_lines(rng: random.Random, n: int, train: list[str]) -> list[str]:
    """``n`` distinct training lines, their counts uniform over 0-10 (the count first, then
    a line with it), so rare counts are asked as often as common ones."""
    by_count: dict[int, list[str]] = {}
    for line in train:
        by_count.setdefault(line.count("*"), []).append(line)
    picked: set[str] = set()
    while len(picked) < n:
        picked.add(rng.choice(by_count[rng.randrange(LENGTH + 1)]))
    # from a sorted list: a set's order changes with each process's string hashing
    return sorted(sorted(picked), key=lambda _: rng.random())


def training_templates(
    seed: int = 0,
    *,
    tasks: int = 256,
    questions: int = 32,
    temperature: float = 1.0,
    partial_credit: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """``tasks`` training templates of ``questions`` distinct lines each (the family's:
    ``family.training_templates``)."""
    return family.training_templates(
        "stars",
        seed,
        tasks=tasks,
        questions=questions,
        temperature=temperature,
        partial_credit=partial_credit,
    )


def heldout_templates(questions: int = 36) -> list[dict[str, Any]]:
    """The fixed held-out set as greedy templates (``HELDOUT_SIZE / questions`` of them)."""
    return family.heldout_templates("stars", questions)


class Stars(TaskFamily):
    """The demo's default family: counts are ordered, so a near miss may earn credit."""

    name = "stars"
    description = f"how many * in a {LENGTH}-character line of * and . (answer 0-{LENGTH})"
    answers = tuple(str(c) for c in range(LENGTH + 1))
    ordered = True

    def train(self) -> list[Item]:
        return [Item(question(x), answer(x)) for x in split()[0]]

    def heldout(self) -> list[Item]:
        return [Item(question(x), answer(x)) for x in split()[1]]

    def sample(self, rng: random.Random, n: int, train: list[Item]) -> list[Item]:
        lines = [line_of(i.question) or "" for i in train]
        return [Item(question(x), answer(x)) for x in training_lines(rng, n, lines)]
