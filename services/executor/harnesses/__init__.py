"""Harness presets, by name. Custom presets load by ``"module:Class"``."""

from __future__ import annotations

from services.common.plugins import Registry
from services.executor.harnesses.base import Harness, HarnessContext, HarnessRun
from services.executor.harnesses.shell import NoopHarness, ShellHarness

__all__ = ["Harness", "HarnessContext", "HarnessRun", "default_registry"]


def default_registry() -> Registry[Harness]:
    reg: Registry[Harness] = Registry("harness")
    reg.register("shell", ShellHarness)
    reg.register("noop", NoopHarness)
    return reg
