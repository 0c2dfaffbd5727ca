"""Gemini CLI (``@google/gemini-cli``): Gemini ``generateContent``.

``GOOGLE_GEMINI_BASE_URL`` and ``GEMINI_API_KEY`` come from the session context, but
env vars alone exit 41 ("Invalid auth method selected"): ``~/.gemini/settings.json``
selects the API-key auth (and turns statistics, telemetry and updates off). ``-m`` skips
the model router's extra call. Shell tool: ``run_shell_command {command}``.
"""

from __future__ import annotations

from services.node.harnesses.base import HarnessContext
from services.node.harnesses.cli import CliHarness, Variant, deep_merge, json_bytes

SETTINGS = {
    "security": {"auth": {"selectedType": "gemini-api-key"}},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
}


class GeminiCliHarness(CliHarness):
    name = "gemini_cli"
    package = "@google/gemini-cli"
    default_version = "0.61.0"
    bin = "gemini"
    node_min = (20, 0)
    own_paths = (".gemini",)
    variants = (Variant("gemini", "gemini"),)

    def config_files(self, ctx: HarnessContext, variant: Variant) -> dict[str, bytes]:
        settings = deep_merge(SETTINGS, ctx.agent.settings.get("config"))
        return {".gemini/settings.json": json_bytes(settings)}

    def command(self, ctx: HarnessContext, variant: Variant) -> tuple[list[str], list[str]]:
        return ["-m", ctx.agent.model, "--yolo", "--skip-trust"], ["-p", ctx.instruction]
