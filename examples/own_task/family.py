"""A task family of your own for the learning demo: "which digit is the most common in a
line of ten digits" (``polar demo --task examples/own_task/family.py``).

The answers are ten *classes* that happen to be written as digits: when the line's most
common digit is ``4``, an answer of ``5`` is as wrong as ``9``. So the family is not
``ordered`` and the demo trains it on the exact reward: near-miss credit (the shaped
reward of the stars task, whose answers are counts) would pay half a reward for a
neighbouring digit, and in the issue's try pulled such a family onto one constant answer
(docs/training.md, "The learning demo's recipe").

A family is a class: a name, a one-line description, the answer space, the training
items and a fixed held-out set (``services/demo/family.py``). Pure: no I/O, no clock.
"""

from __future__ import annotations

import functools
import random

from services.demo.family import Item, TaskFamily

DIGITS = "0123456789"
LENGTH, TOP = 10, 6  # ten digits, the most common one six times, the others at random
PER_ANSWER = 300  # lines per answer, drawn once by a fixed seed
HELDOUT_PER_ANSWER = 12
POOL_SEED = 20261215


def question(line: str) -> str:
    return f"Most common digit in {line}?"


def line_with(top: str, rng: random.Random) -> str:
    """``TOP`` times ``top``, the rest other digits: ``top`` is the only most common one."""
    cells = [top] * TOP + [rng.choice(DIGITS.replace(top, "")) for _ in range(LENGTH - TOP)]
    rng.shuffle(cells)
    return "".join(cells)


@functools.cache
def pool() -> tuple[list[Item], list[Item]]:
    """(train, held-out): ``PER_ANSWER`` distinct lines per answer, ``HELDOUT_PER_ANSWER``
    of them held out (never trained on), the same on every machine."""
    rng = random.Random(POOL_SEED)
    train: list[Item] = []
    heldout: list[Item] = []
    for top in DIGITS:
        lines: set[str] = set()
        while len(lines) < PER_ANSWER:
            lines.add(line_with(top, rng))
        ordered = sorted(lines)
        held = set(rng.sample(ordered, HELDOUT_PER_ANSWER))
        heldout += [Item(question(x), top) for x in ordered if x in held]
        train += [Item(question(x), top) for x in ordered if x not in held]
    return train, heldout


class MostCommonDigit(TaskFamily):
    name = "most_common_digit"
    description = "which digit is the most common in a line of ten (ten classes)"
    answers = tuple(DIGITS)
    ordered = False  # classes, not quantities: the exact reward

    def train(self) -> list[Item]:
        return pool()[0]

    def heldout(self) -> list[Item]:
        return pool()[1]
