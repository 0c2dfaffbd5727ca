"""Builder strategies and their registry.

Nothing registers itself at import time: ``default_registry()`` builds the registry of the
built-in strategies; ``resolve`` also loads a custom builder named ``"module:Class"``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from services.builder.strategies.base import BuildError, TrajectoryBuilder
from services.builder.strategies.per_request import PerRequest
from services.builder.strategies.prefix_merging import PrefixMerging

_CUSTOM = re.compile(r"^(?P<module>[A-Za-z_][\w.]*):(?P<attr>[A-Za-z_]\w*)$")

Factory = Callable[[], TrajectoryBuilder]


class BuilderRegistry:
    def __init__(self) -> None:
        self._factories: dict[str, Factory] = {}

    def register(self, name: str, factory: Factory) -> None:
        if name in self._factories:
            raise BuildError(f"builder {name!r} is already registered")
        if ":" in name:
            raise BuildError(f"builder name {name!r} must not contain ':' (kept for module:Class)")
        self._factories[name] = factory

    def names(self) -> list[str]:
        return sorted(self._factories)

    def resolve(self, name: str) -> TrajectoryBuilder:
        """A builder instance for a registered name or a ``"module:Class"`` path."""
        factory = self._factories.get(name)
        if factory is not None:
            return factory()
        if ":" not in name:
            known = ", ".join(self.names()) or "none"
            raise BuildError(
                f"unknown builder {name!r}: use one of {known}, or 'module:Class' for a custom one"
            )
        factory = load_custom(name)
        try:
            return factory()
        except Exception as exc:  # noqa: BLE001 - third-party code: report, do not crash
            raise BuildError(f"custom builder {name!r} could not be created: {exc!r}") from None


def load_custom(path: str) -> Factory:
    """The class (or factory) a ``"module:Class"`` path names, checked to be a builder."""
    m = _CUSTOM.match(path)
    if not m:
        raise BuildError(f"custom builder {path!r} is not of the form 'package.module:ClassName'")
    module_name, attr = m["module"], m["attr"]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BuildError(
            f"custom builder {path!r}: cannot import module {module_name!r} ({exc}); "
            "install it or put it on the builder service's PYTHONPATH"
        ) from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise BuildError(
            f"custom builder {path!r}: module {module_name!r} has no attribute {attr!r}; "
            "check the class name after the ':'"
        )
    if not callable(factory) or not callable(getattr(factory, "build", None)):
        raise BuildError(
            f"custom builder {path!r} is not a builder: it must be a class with a "
            "build(records, config, outcome) method returning (traces, stats)"
        )
    return factory


def default_registry() -> BuilderRegistry:
    reg = BuilderRegistry()
    reg.register(PerRequest.name, PerRequest)
    reg.register(PrefixMerging.name, PrefixMerging)
    return reg


__all__ = ["BuildError", "BuilderRegistry", "TrajectoryBuilder", "default_registry", "load_custom"]
