"""Builder strategies and their registry (the shared plugin registry, raising BuildError).

Nothing registers itself at import time: ``default_registry()`` builds the registry of the
built-in strategies; ``create`` also loads a custom builder named ``"module:Class"``.
"""

from __future__ import annotations

from services.builder.strategies.base import BuildError, TrajectoryBuilder
from services.builder.strategies.per_request import PerRequest
from services.builder.strategies.prefix_merging import PrefixMerging
from services.common.plugins import Registry

BuilderRegistry = Registry[TrajectoryBuilder]


def _is_builder(factory: object) -> str | None:
    if callable(getattr(factory, "build", None)):
        return None
    return (
        "it must be a class with a build(records, config, outcome) method returning (traces, stats)"
    )


def builder_registry() -> BuilderRegistry:
    """An empty builder registry."""
    return Registry("builder", error=BuildError, check=_is_builder)


def default_registry() -> BuilderRegistry:
    reg = builder_registry()
    reg.register(PerRequest.name, PerRequest)
    reg.register(PrefixMerging.name, PrefixMerging)
    return reg


__all__ = [
    "BuildError",
    "BuilderRegistry",
    "TrajectoryBuilder",
    "builder_registry",
    "default_registry",
]
