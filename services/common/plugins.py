"""Named plugin registries (harness presets, builders, evaluators).

``register`` raises on duplicates; ``resolve("module:Class")`` loads a custom plugin with an
error that says how to fix it. Nothing registers itself at import time: each service
builds its registry explicitly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PluginError(LookupError):
    pass


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Callable[[], T]] = {}

    def register(self, name: str, factory: Callable[[], T]) -> None:
        if name in self._items:
            raise PluginError(f"{self.kind} {name!r} is already registered")
        self._items[name] = factory

    def names(self) -> list[str]:
        return sorted(self._items)

    def create(self, name: str) -> T:
        factory = self._items.get(name)
        if factory is None:
            factory = self._load(name)
        return factory()

    def _load(self, name: str) -> Callable[[], T]:
        if ":" not in name:
            known = ", ".join(self.names())
            raise PluginError(
                f"unknown {self.kind} {name!r}: use one of {known}, or 'module:Class'"
            )
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise PluginError(
                f"custom {self.kind} {name!r}: cannot import {module_name!r} ({exc}); "
                "install the package that provides it on this node"
            ) from None
        obj = getattr(module, attr, None)
        if obj is None or not callable(obj):
            raise PluginError(
                f"custom {self.kind} {name!r}: {module_name} has no callable {attr!r}"
            )
        return obj
