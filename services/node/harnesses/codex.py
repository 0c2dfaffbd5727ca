"""Codex CLI (``@openai/codex``): OpenAI Responses only, through a custom provider.

``OPENAI_BASE_URL`` is ignored by Codex and its built-in provider first tries WebSocket
upgrades; a custom provider in ``$CODEX_HOME/config.toml`` with ``wire_api="responses"``
goes straight to ``POST <base>/responses``. The key is read from ``OPENAI_API_KEY``
(the session token). Shell tool: ``exec_command {cmd}``.
"""

from __future__ import annotations

import json
import posixpath

from services.node.harnesses.base import HarnessContext
from services.node.harnesses.cli import CliHarness, Variant


def config_toml(ctx: HarnessContext) -> bytes:
    q = json.dumps  # TOML basic strings take JSON's escapes
    lines = [
        f"model = {q(ctx.agent.model)}",
        'model_provider = "polar"',
        'approval_policy = "never"',
        'sandbox_mode = "danger-full-access"',
        "check_for_update_on_startup = false",
        "",
        "[analytics]",
        "enabled = false",
        "",
        "[model_providers.polar]",
        'name = "Polar"',
        f"base_url = {q(ctx.openai_base_url)}",
        'env_key = "OPENAI_API_KEY"',
        'wire_api = "responses"',
    ]
    return ("\n".join(lines) + "\n").encode()


class CodexHarness(CliHarness):
    name = "codex"
    package = "@openai/codex"
    default_version = "0.171.0"
    bin = "codex"
    own_paths = (".codex",)
    variants = (Variant("responses", "openai_responses"),)

    def session_env(self, ctx: HarnessContext, variant: Variant) -> dict[str, str]:
        return {"CODEX_HOME": posixpath.join(ctx.home, ".codex")}

    def config_files(self, ctx: HarnessContext, variant: Variant) -> dict[str, bytes]:
        return {".codex/config.toml": config_toml(ctx)}

    def command(self, ctx: HarnessContext, variant: Variant) -> tuple[list[str], list[str]]:
        options = [
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            "-C",
            ctx.workdir,
            "-m",
            ctx.agent.model,
        ]
        return options, ["--", ctx.instruction]
