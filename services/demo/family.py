"""What the learning demo needs of a task: a *family* of one-line questions, each with one
right answer from a fixed answer space.

Everything else in the demo is built from it: the format warm start (answers drawn from
``answers`` at random, nothing about the task), the training templates (``questions``
distinct training items per session, one chat call and one trace each, scored by
``exact_answer``), and the fixed held-out set measured greedily through the stack.
The stars task (``services/demo/stars.py``) is the default family; a user's own::

    from services.demo.family import Item, TaskFamily

    class MostCommonDigit(TaskFamily):      # examples/own_task/family.py
        name = "most_common_digit"
        description = "which digit is the most common in a line of ten"
        answers = tuple("0123456789")        # the answer space
        def train(self) -> list[Item]: ...   # the items the trainer samples from
        def heldout(self) -> list[Item]: ... # fixed, never trained on

    polar demo --task examples/own_task/family.py    # a file's one TaskFamily subclass
    polar demo --task my_pkg.tasks:MostCommonDigit   # or an importable one

The reward is exact (1 for the right answer, else 0) unless the family sets
``ordered = True``: its answers are integers whose distance means closeness (a count),
and a near miss may then earn part of a reward (the demo's shaped reward,
docs/training.md says what it assumes). Pure functions apart from loading a family.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import random
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.demo.topology import MODEL_NAME

AGENT = Path(__file__).resolve().parents[2] / "infra" / "demo" / "quiz_agent.py"
BUILTIN = {"stars": "services.demo.stars:Stars"}
DEFAULT = "stars"


class FamilyError(ValueError):
    """A task family that cannot be loaded or used, with what to change."""


@dataclass(frozen=True)
class Item:
    question: str  # one line: the quiz agent asks each line of its instruction alone
    answer: str  # the right answer, exactly (one of the family's answers)


class TaskFamily(ABC):
    """Subclass it: set ``name``, ``description`` and ``answers``; return the items from
    ``train`` and ``heldout``. ``sample`` may be overridden (default: answers uniform)."""

    name: str = ""
    description: str = ""
    answers: tuple[str, ...] = ()
    # integers whose distance means closeness: near-miss credit (the shaped reward) fits
    ordered: bool = False

    @abstractmethod
    def train(self) -> list[Item]:
        """The training items."""

    @abstractmethod
    def heldout(self) -> list[Item]:
        """The held-out items, never trained on."""

    def sample(self, rng: random.Random, n: int, train: list[Item]) -> list[Item]:
        """``n`` distinct training items, their answers uniform over the answers that
        have training items (an answer first, then an item with it): rare answers are
        asked as often as common ones."""
        if n > len(train):
            raise FamilyError(f"{self.name}: {n} questions a session, {len(train)} items")
        by_answer: dict[str, list[Item]] = {}
        for item in train:
            by_answer.setdefault(item.answer, []).append(item)
        keys = sorted(by_answer)
        picked: dict[str, Item] = {}
        while len(picked) < n:
            item = rng.choice(by_answer[rng.choice(keys)])
            picked[item.question] = item
        return sorted(picked.values(), key=lambda _: rng.random())


# -- loading ------------------------------------------------------------------------------


def load_family(spec: str | TaskFamily) -> TaskFamily:
    """The family ``spec`` names: a built-in name (``stars``), ``module:Class``, a file
    (``path/tasks.py``: its one TaskFamily subclass) or ``path/tasks.py:Class``;
    checked (``check``) before it is returned."""
    if isinstance(spec, TaskFamily):
        return check(spec)
    where, attr = _split(BUILTIN.get(spec, spec))
    module = _module(where, spec)
    obj = getattr(module, attr, None) if attr else _only_family(module, spec)
    if obj is None:
        raise FamilyError(f"--task {spec!r}: {module.__name__} has no {attr!r}")
    if inspect.isclass(obj) and issubclass(obj, TaskFamily):
        if inspect.isabstract(obj):  # a user's class that lacks train() or heldout()
            missing = ", ".join(sorted(obj.__abstractmethods__))
            raise FamilyError(f"--task {spec!r}: {obj.__name__} does not define {missing}")
        obj = obj()
    if not isinstance(obj, TaskFamily):
        raise FamilyError(
            f"--task {spec!r} names {obj!r}, not a TaskFamily: subclass "
            "services.demo.family.TaskFamily (its docstring shows one)"
        )
    return check(obj)


def _split(spec: str) -> tuple[str, str]:
    """(module or file, attribute name or "")."""
    where, _, attr = spec.rpartition(":") if ":" in spec else (spec, "", "")
    return where, attr


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where


def portable(spec: str) -> str:
    """``spec`` as another process loads it wherever it runs: a file by its absolute path."""
    where, attr = _split(spec)
    if not _is_file(where):
        return spec
    return str(Path(where).resolve()) + (f":{attr}" if attr else "")


def _module(where: str, spec: str):
    if _is_file(where):
        path = Path(where).resolve()
        if not path.is_file():
            raise FamilyError(f"--task {spec!r}: no file {path}")
        name = f"polar_task_family_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
        if name in sys.modules:
            return sys.modules[name]
        loader = importlib.util.spec_from_file_location(name, path)
        assert loader is not None and loader.loader is not None
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module  # dataclasses in it look their module up
        loader.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(where)
    except ImportError as exc:
        raise FamilyError(
            f"--task {spec!r}: cannot import {where!r} ({exc}); give a file path "
            "(tasks.py) or an importable 'module:Class'"
        ) from None


def _only_family(module, spec: str) -> type[TaskFamily]:
    found = [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj)
        and issubclass(obj, TaskFamily)
        and obj is not TaskFamily
        and obj.__module__ == module.__name__
    ]
    if len(found) != 1:
        names = ", ".join(c.__name__ for c in found) or "none"
        raise FamilyError(
            f"--task {spec!r}: the file must define exactly one TaskFamily subclass "
            f"(found {names}); name one as {spec}:Class"
        )
    return found[0]


def check(family: TaskFamily) -> TaskFamily:
    """Refuse a family the demo cannot run, saying what is wrong with it."""
    name = family.name or type(family).__name__
    if not family.name or not family.name.replace("_", "").isalnum():
        raise FamilyError(f"{name}: set `name` (letters, digits, _): it names the run's files")
    if len(set(family.answers)) < 2:
        raise FamilyError(f"{name}: `answers` needs two or more distinct answers")
    space = set(family.answers)
    train, heldout = family.train(), family.heldout()
    if not train or not heldout:
        raise FamilyError(f"{name}: train() and heldout() must both return items")
    seen: dict[str, str] = {}
    for item in [*train, *heldout]:
        q = item.question
        if not q.strip() or "\n" in q or q != q.strip():
            raise FamilyError(f"{name}: a question is one non-empty line, not {q!r}")
        if item.answer not in space:
            raise FamilyError(f"{name}: answer {item.answer!r} of {q!r} is not in `answers`")
        if seen.setdefault(q, item.answer) != item.answer:
            raise FamilyError(f"{name}: {q!r} has two answers")
    overlap = {i.question for i in train} & {i.question for i in heldout}
    if overlap:
        raise FamilyError(f"{name}: {len(overlap)} held-out questions are training ones too")
    if family.ordered and not all(_is_int(a) for a in family.answers):
        raise FamilyError(f"{name}: ordered=True needs integer answers (near-miss distance)")
    return family


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def key(family: TaskFamily) -> str:
    """Names what a warm start of this family depends on: its name, answer space and
    training questions (a cache of warm starts keys on it)."""
    blob = json.dumps([family.name, list(family.answers), [i.question for i in family.train()]])
    return f"{family.name}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def max_tokens(family: TaskFamily) -> int:
    """The quiz agent's token limit: the longest answer's bytes (one token each in the
    demo's byte vocabulary), the end of turn, and one spare."""
    return max(len(a.encode()) for a in family.answers) + 2


# -- the demo's reward --------------------------------------------------------------------

REWARDS = ("auto", "exact", "shaped")


def reward_credit(
    family: TaskFamily, reward: str, credit: tuple[float, int]
) -> tuple[float, int] | None:
    """The near-miss credit the training reward carries: ``credit`` for ``shaped``
    (``auto``: for ordered families), None for ``exact``."""
    if reward not in REWARDS:
        raise FamilyError(f"reward must be one of {REWARDS}, not {reward!r}")
    shaped = reward == "shaped" or (reward == "auto" and family.ordered)
    if shaped and not family.ordered:
        raise FamilyError(
            f"{family.name}: the shaped reward gives near misses part of a reward, which "
            "assumes ordered numeric answers; this family's answers are unordered classes "
            "(set ordered=True if their distance means closeness, or use --reward exact)"
        )
    return credit if shaped else None


# -- task templates -----------------------------------------------------------------------


def template(
    family: TaskFamily,
    items: list[Item],
    *,
    temperature: float,
    split_name: str,
    python: str = sys.executable,
    partial_credit: dict[str, Any] | None = None,
    sandbox: str = "auto",
) -> dict[str, Any]:
    """A task template (a TaskRequest without id and sample count, as JSON data) asking
    each of ``items`` once per session; ``partial_credit`` (``exact_answer``'s) shapes
    the training reward, and the held-out set is scored without it. ``sandbox`` is the
    local runtime's (the demo names it: ``run.demo_sandbox``)."""
    scoring: dict[str, Any] = {"answers": {i.question: i.answer for i in items}}
    if partial_credit is not None:
        scoring["partial_credit"] = partial_credit
    return {
        "instruction": "\n".join(i.question for i in items),
        "timeout_seconds": 300,
        "agent_timeout_seconds": 120,
        "runtime": {
            "backend": "local",
            "sandbox": sandbox,
            "prepare": [{"action": "upload_file", "src": str(AGENT), "dest": "quiz_agent.py"}],
        },
        "agent": {
            "harness": "shell",
            "command": f"{python} quiz_agent.py",
            "model": MODEL_NAME,
            "env": {
                "QUIZ_TEMPERATURE": str(temperature),
                "QUIZ_MAX_TOKENS": str(max_tokens(family)),
            },
        },
        "builder": {"name": "per_request"},
        "evaluator": {"name": "exact_answer", "config": scoring},
        "metadata": {"family": family.name, "split": split_name},
    }


def training_templates(
    family: str = DEFAULT,
    seed: int = 0,
    *,
    tasks: int = 256,
    questions: int = 32,
    temperature: float = 1.0,
    partial_credit: dict[str, Any] | None = None,
    sandbox: str = "auto",
) -> list[dict[str, Any]]:
    """``tasks`` training templates of ``questions`` distinct training items each (the
    trainer's task source cycles through them: ``tasks.generator`` with these args)."""
    fam = load_family(family)
    train = fam.train()
    rng = random.Random(seed)
    return [
        template(
            fam,
            fam.sample(rng, questions, train),
            temperature=temperature,
            split_name="train",
            partial_credit=partial_credit,
            sandbox=sandbox,
        )
        for _ in range(tasks)
    ]


def heldout_templates(
    family: str | TaskFamily = DEFAULT, questions: int = 36, sandbox: str = "auto"
) -> list[dict]:
    """The fixed held-out set as greedy templates of at most ``questions`` items each, all
    the same size where the set allows (the trainer's accuracy is the mean of the
    sessions' scores: a short last session would weigh its few questions more)."""
    fam = load_family(family)
    items = fam.heldout()
    return [
        template(fam, chunk, temperature=0.0, split_name="heldout", sandbox=sandbox)
        for chunk in even_chunks(items, questions)
    ]


def even_chunks(items: list, most: int) -> list[list]:
    """``items`` in order, in the fewest chunks of at most ``most`` whose sizes are equal
    (allowing up to twice as many chunks to find equal ones), else differ by one."""
    n = len(items)
    least = -(-n // most)
    k = next((k for k in range(least, 2 * least + 1) if n % k == 0), least)
    size, extra = divmod(n, k)
    bounds = [i * size + min(i, extra) for i in range(k + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
