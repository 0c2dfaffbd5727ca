"""Harness presets, by name. Custom presets load by ``"module:Class"``."""

from __future__ import annotations

from services.common.plugins import Registry
from services.node.harnesses.base import Harness, HarnessContext, HarnessRun
from services.node.harnesses.claude_code import ClaudeCodeHarness
from services.node.harnesses.codex import CodexHarness
from services.node.harnesses.gemini_cli import GeminiCliHarness
from services.node.harnesses.opencode import OpencodeHarness
from services.node.harnesses.pi import PiHarness
from services.node.harnesses.qwen_code import QwenCodeHarness
from services.node.harnesses.shell import NoopHarness, ShellHarness

__all__ = ["CLI_PRESETS", "Harness", "HarnessContext", "HarnessRun", "default_registry"]

# The agent CLIs installed from npm, by preset name.
CLI_PRESETS = {
    cls.name: cls
    for cls in (
        CodexHarness,
        ClaudeCodeHarness,
        GeminiCliHarness,
        QwenCodeHarness,
        OpencodeHarness,
        PiHarness,
    )
}


def _is_harness(cls: object) -> str | None:
    if isinstance(cls, type) and issubclass(cls, Harness):
        return None
    return (
        "it must be a subclass of Harness (services.node.harnesses.base; CliHarness for an npm CLI)"
    )


def default_registry() -> Registry[Harness]:
    reg: Registry[Harness] = Registry("harness", check=_is_harness)
    reg.register("shell", ShellHarness)
    reg.register("noop", NoopHarness)
    for name, cls in CLI_PRESETS.items():
        reg.register(name, cls)
    return reg
