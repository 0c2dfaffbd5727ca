"""Named plugin registries: harness presets, builders and evaluators all use this one.

``register`` raises on duplicates; ``create("module:Class")`` loads a custom plugin with an
error that says how to fix it. Nothing registers itself at import time: each service
builds its registry explicitly.

A custom plugin must be a class, and of its registry's kind (``check``), before anything
of it is called: ``"os:abort"`` names a callable, and creating it killed the service
that loaded it (issue 33). The scheduler runs the same ``load_custom`` on each task it is
given, in a child process (``services/scheduler/plugincheck.py``), and refuses the task.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

_CUSTOM = re.compile(r"^(?P<module>[A-Za-z_][\w.]*):(?P<attr>[A-Za-z_]\w*)$")


class PluginError(LookupError):
    pass


class Registry(Generic[T]):
    """Factories by name, plus custom ones loaded from ``"module:Class"``.

    ``error``: the exception raised (a service's own error type, so its callers catch
    one kind). ``check``: for a custom class, why it is not a plugin of this kind
    (None: it is one); it is asked before the class is called.
    """

    def __init__(
        self,
        kind: str,
        *,
        error: type[Exception] = PluginError,
        check: Callable[[object], str | None] | None = None,
    ) -> None:
        self.kind = kind
        self.error = error
        self.check = check
        self._items: dict[str, Callable[[], T]] = {}

    def register(self, name: str, factory: Callable[[], T]) -> None:
        if name in self._items:
            raise self.error(f"{self.kind} {name!r} is already registered")
        if ":" in name:
            raise self.error(
                f"{self.kind} name {name!r} must not contain ':' (kept for module:Class)"
            )
        self._items[name] = factory

    def names(self) -> list[str]:
        return sorted(self._items)

    def create(self, name: str) -> T:
        """A new instance of the plugin ``name`` names."""
        factory = self._items.get(name)
        if factory is not None:
            return factory()
        factory = self.load_custom(name)
        try:
            return factory()
        except Exception as exc:  # noqa: BLE001 - third-party code: report, do not crash
            raise self.error(f"custom {self.kind} {name!r} could not be created: {exc!r}") from None

    def load_custom(self, path: str) -> Callable[[], T]:
        """The class a ``"module:Class"`` path names, checked by ``check`` (nothing of
        it is called here: its module's import-time code is all that runs)."""
        if ":" not in path:
            known = ", ".join(self.names()) or "none"
            raise self.error(
                f"unknown {self.kind} {path!r}: use one of {known}, "
                "or 'module:Class' for a custom one"
            )
        m = _CUSTOM.match(path)
        if not m:
            raise self.error(
                f"custom {self.kind} {path!r} is not of the form 'package.module:ClassName'"
            )
        module_name, attr = m["module"], m["attr"]
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise self.error(
                f"custom {self.kind} {path!r}: cannot import module {module_name!r} ({exc}); "
                "install it or put it on the PYTHONPATH of the service that loads it"
            ) from None
        factory = getattr(module, attr, None)
        if factory is None or not callable(factory):
            raise self.error(
                f"custom {self.kind} {path!r}: module {module_name!r} has no callable {attr!r}; "
                "check the name after the ':'"
            )
        problem = self.check(factory) if self.check else None  # it calls nothing
        article = "an" if self.kind[:1] in "aeiou" else "a"
        if not inspect.isclass(factory):
            raise self.error(
                f"custom {self.kind} {path!r} is a {type(factory).__name__}, not a class: "
                f"name {article} {self.kind} class ('package.module:ClassName')"
                + (f"; {problem}" if problem else "")
            )
        if problem:
            raise self.error(f"custom {self.kind} {path!r} is not {article} {self.kind}: {problem}")
        return factory
