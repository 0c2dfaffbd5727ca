"""The learning demo's task family: "how many `*` in a 10-character line of `*` and `.`".

All 1,024 lines split once, by a fixed seed, into a held-out set (``HELDOUT_SIZE`` lines,
never trained on) and the training lines. A task template asks ``questions`` distinct
lines, one question per line of its instruction (what ``infra/demo/quiz_agent.py`` asks,
one chat call each, so one trace each); the expected answers are in the evaluator's
config (``exact_answer``, one reward per trace), which the agent never sees. Pure
functions: no I/O, no clock.
"""

from __future__ import annotations

import itertools
import random
import re
import sys
from pathlib import Path
from typing import Any

LENGTH = 10
# held-out lines per count: near-uniform, and most of counts 1 and 9 (10 lines each) left
# for training; counts 0 and 10 (one line each) are training-only
HELDOUT_PER_COUNT = {1: 4, 2: 14, 3: 14, 4: 15, 5: 14, 6: 15, 7: 14, 8: 14, 9: 4}
HELDOUT_SIZE = sum(HELDOUT_PER_COUNT.values())  # 108
SPLIT_SEED = 20261201
QUESTION = "How many * in {line}?"
AGENT = Path(__file__).resolve().parents[2] / "infra" / "demo" / "quiz_agent.py"
_LINE = re.compile(rf"[*.]{{{LENGTH}}}")


def all_lines() -> list[str]:
    return ["".join(p) for p in itertools.product("*.", repeat=LENGTH)]


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


def template(
    lines: list[str],
    *,
    temperature: float,
    python: str = sys.executable,
    split_name: str,
    partial_credit: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A task template (a TaskRequest without id and sample count, as JSON data) asking each
    of ``lines`` once per session; ``partial_credit`` (``exact_answer``'s) shapes the
    training reward, and the held-out set is scored without it."""
    questions = [question(line) for line in lines]
    scoring: dict[str, Any] = {
        "answers": {q: answer(line) for q, line in zip(questions, lines, strict=True)}
    }
    if partial_credit is not None:
        scoring["partial_credit"] = partial_credit
    return {
        "instruction": "\n".join(questions),
        "timeout_seconds": 300,
        "agent_timeout_seconds": 120,
        "runtime": {
            "backend": "local",
            "prepare": [{"action": "upload_file", "src": str(AGENT), "dest": "quiz_agent.py"}],
        },
        "agent": {
            "harness": "shell",
            "command": f"{python} quiz_agent.py",
            "model": "polar-stars",
            "env": {"QUIZ_TEMPERATURE": str(temperature), "QUIZ_MAX_TOKENS": "4"},
        },
        "builder": {"name": "per_request"},
        "evaluator": {"name": "exact_answer", "config": scoring},
        "metadata": {"family": "stars", "split": split_name},
    }


def training_lines(rng: random.Random, n: int, train: list[str]) -> list[str]:
    """``n`` distinct training lines, their counts uniform over 0-10 (the count first, then
    a line with it), so rare counts are asked as often as common ones."""
    by_count: dict[int, list[str]] = {}
    for line in train:
        by_count.setdefault(line.count("*"), []).append(line)
    picked: set[str] = set()
    while len(picked) < n:
        picked.add(rng.choice(by_count[rng.randrange(LENGTH + 1)]))
    return sorted(picked, key=lambda _: rng.random())


def training_templates(
    seed: int = 0,
    *,
    tasks: int = 256,
    questions: int = 32,
    temperature: float = 1.0,
    partial_credit: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """``tasks`` training templates of ``questions`` distinct lines each (the trainer's
    task source cycles through them: ``tasks.generator``)."""
    train, _ = split()
    rng = random.Random(seed)
    return [
        template(
            training_lines(rng, questions, train),
            temperature=temperature,
            split_name="train",
            partial_credit=partial_credit,
        )
        for _ in range(tasks)
    ]


def heldout_templates(questions: int = 36) -> list[dict[str, Any]]:
    """The fixed held-out set as greedy templates (``HELDOUT_SIZE / questions`` of them)."""
    _, heldout = split()
    return [
        template(heldout[i : i + questions], temperature=0.0, split_name="heldout")
        for i in range(0, len(heldout), questions)
    ]
