"""Collecting GRPO groups: all ``num_samples`` trajectories of a task (pure, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
Key = tuple[str, int]  # (session_id, attempt)


@dataclass
class Pending(Generic[T]):
    expected: int | None
    items: dict[Key, T] = field(default_factory=dict)
    last_added: float = 0.0


class GroupBuffer(Generic[T]):
    """Trajectories held per task until their group is whole."""

    def __init__(self) -> None:
        self.tasks: dict[str, Pending[T]] = {}

    def add(
        self, task_id: str, key: Key, item: T, expected: int | None, now: float
    ) -> list[T] | None:
        """Add one member; returns the whole group (and forgets it) once complete."""
        pending = self.tasks.setdefault(task_id, Pending(expected))
        if expected is not None:
            pending.expected = expected
        pending.items[key] = item
        pending.last_added = now
        if pending.expected is not None and len(pending.items) >= pending.expected:
            del self.tasks[task_id]
            return list(pending.items.values())
        return None

    def has(self, task_id: str, key: Key) -> bool:
        pending = self.tasks.get(task_id)
        return pending is not None and key in pending.items

    def stale(self, now: float, after: float) -> list[tuple[str, list[T]]]:
        """Incomplete groups that got no new member for ``after`` seconds (forgotten)."""
        out = [
            (t, list(p.items.values()))
            for t, p in self.tasks.items()
            if now - p.last_added >= after
        ]
        for task_id, _ in out:
            del self.tasks[task_id]
        return out

    def held(self) -> int:
        return sum(len(p.items) for p in self.tasks.values())


def expected_size(metadata: dict[str, object], override: int | None) -> int | None:
    """A group's size: the caller's, else what the evaluator wrote into the trajectory."""
    if override is not None:
        return override
    n = metadata.get("num_samples")
    return n if isinstance(n, int) and n > 0 else None
