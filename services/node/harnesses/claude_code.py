"""Claude Code (``@anthropic-ai/claude-code``): Anthropic Messages.

``ANTHROPIC_BASE_URL`` (no ``/v1``) and ``ANTHROPIC_API_KEY`` come from the session
context. As root, ``--dangerously-skip-permissions`` needs ``IS_SANDBOX=1``. Telemetry,
update checks and other non-essential traffic are off. When a stream has no
``message_start`` it retries the call with ``stream: false`` (its non-streaming
fallback), which the proxy serves as well. Shell tool: ``Bash {command}``.
"""

from __future__ import annotations

from services.node.harnesses.base import HarnessContext
from services.node.harnesses.cli import CliHarness, Variant


class ClaudeCodeHarness(CliHarness):
    name = "claude_code"
    package = "@anthropic-ai/claude-code"
    default_version = "2.1.332"
    bin = "claude"  # a native executable: no Node needed at run time
    own_paths = (".claude",)
    variants = (Variant("anthropic", "anthropic_messages"),)

    def session_env(self, ctx: HarnessContext, variant: Variant) -> dict[str, str]:
        return {
            "IS_SANDBOX": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
        }

    def command(self, ctx: HarnessContext, variant: Variant) -> tuple[list[str], list[str]]:
        options = ["-p", "--dangerously-skip-permissions", "--model", ctx.agent.model]
        return options, ["--", ctx.instruction]
