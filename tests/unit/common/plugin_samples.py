"""Things a task may name as ``"module:attr"`` that are not plugins (issue 33): loading
one must refuse it without calling it."""

from __future__ import annotations

CALLED: list[str] = []


def a_function() -> None:
    CALLED.append("a_function")


class NotAPlugin:
    def __init__(self) -> None:
        CALLED.append("NotAPlugin")
