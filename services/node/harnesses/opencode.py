"""opencode (``opencode-ai``): Chat Completions through an OpenAI-compatible provider.

The provider is inline config (``OPENCODE_CONFIG_CONTENT``): ``@ai-sdk/openai-compatible``
at the session's ``/v1`` base URL, the key read from ``OPENAI_API_KEY`` by opencode's
``{env:...}`` substitution (the token is not written into the config), the model declared
under ``models``. Model list fetches, updates, sharing and LSP downloads are off;
``--auto`` approves every tool. Its first call is a title request without tools (a side
call the proxy tags). Shell tool: ``bash {command, description}``.
"""

from __future__ import annotations

import json

from services.node.harnesses.base import HarnessContext
from services.node.harnesses.cli import CliHarness, Variant, deep_merge

PROVIDER = "polar"


def inline_config(ctx: HarnessContext) -> dict:
    model = ctx.agent.model
    config = {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "model": f"{PROVIDER}/{model}",
        "provider": {
            PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Polar",
                "options": {"baseURL": ctx.openai_base_url, "apiKey": "{env:OPENAI_API_KEY}"},
                "models": {model: {"name": model}},
            }
        },
    }
    return deep_merge(config, ctx.agent.settings.get("config"))


class OpencodeHarness(CliHarness):
    name = "opencode"
    package = "opencode-ai"
    default_version = "1.18.33"
    bin = "opencode"  # a native executable
    own_paths = (".local/share/opencode/log", ".opencode")
    variants = (Variant("openai-compatible", "openai_chat"),)

    def session_env(self, ctx: HarnessContext, variant: Variant) -> dict[str, str]:
        return {
            "OPENCODE_CONFIG_CONTENT": json.dumps(inline_config(ctx)),
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        }

    def command(self, ctx: HarnessContext, variant: Variant) -> tuple[list[str], list[str]]:
        model = f"{PROVIDER}/{ctx.agent.model}"
        return ["run", "--dir", ctx.workdir, "-m", model, "--auto"], [ctx.instruction]
