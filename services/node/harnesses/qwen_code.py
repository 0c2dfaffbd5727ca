"""Qwen Code (``@qwen-code/qwen-code``): Chat Completions, Anthropic Messages or Responses.

``--auth-type`` picks the protocol (``openai`` | ``anthropic`` | ``openai-responses``);
the base URLs, keys and model names come from the session context's ``OPENAI_*`` /
``ANTHROPIC_*`` variables. ``~/.qwen/settings.json`` turns statistics, telemetry, updates
and managed auto-memory off: every session starts from a fresh HOME, so remembering
helps nobody and would cost a model call after the answer. Needs Node >= 22 (on older
Node, npm silently picks an old release). Shell tool: ``run_shell_command {command}``.
"""

from __future__ import annotations

from services.node.harnesses.base import HarnessContext
from services.node.harnesses.cli import CliHarness, Variant, deep_merge, json_bytes

SETTINGS = {
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "general": {"enableAutoUpdate": False},
    "memory": {"enableManagedAutoMemory": False},
}


class QwenCodeHarness(CliHarness):
    name = "qwen_code"
    package = "@qwen-code/qwen-code"
    default_version = "0.24.4"
    bin = "qwen"
    node_min = (22, 0)
    own_paths = (".qwen",)
    variants = (
        Variant("openai", "openai_chat"),
        Variant("anthropic", "anthropic_messages"),
        Variant("openai-responses", "openai_responses"),
    )

    def session_env(self, ctx: HarnessContext, variant: Variant) -> dict[str, str]:
        return {"QWEN_CODE_SUPPRESS_YOLO_WARNING": "1"}

    def config_files(self, ctx: HarnessContext, variant: Variant) -> dict[str, bytes]:
        settings = deep_merge(SETTINGS, ctx.agent.settings.get("config"))
        return {".qwen/settings.json": json_bytes(settings)}

    def command(self, ctx: HarnessContext, variant: Variant) -> tuple[list[str], list[str]]:
        options = ["--auth-type", variant.cli_name, "--yolo", "--model", ctx.agent.model]
        return options, [ctx.instruction]
