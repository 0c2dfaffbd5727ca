"""pi (``@earendil-works/pi-coding-agent``; before 1.0 ``@mariozechner/pi-coding-agent``).

No env var points pi at a server: ``~/.pi/agent/models.json`` declares a provider with a
``baseUrl``, one of pi's four ``api``s and the key (1.x: ``"$VAR"``; 0.x: the variable's
name). Google's client appends no version to a custom base URL, so that one ends in
``/v1beta``. ``agent.settings.config`` is merged into it (e.g. a model's ``maxTokens``:
pi asks for 16384 output tokens unless told). pi 0.x can exit 0 after a failed model call (a stream it could not parse):
a run that prints no answer is judged an error whatever the exit code. Shell tool:
``bash {command}``.
"""

from __future__ import annotations

from schemas import Outcome
from services.node.harnesses.base import HarnessContext
from services.node.harnesses.cli import CliHarness, Variant, deep_merge, json_bytes

PROVIDER = "polar"
KEY_ENV = "OPENAI_API_KEY"  # the session token (HarnessContext.env)


def is_legacy(version: str) -> bool:
    return version.split(".", 1)[0] == "0"


def base_url(ctx: HarnessContext, api: str) -> str:
    if api == "anthropic-messages":
        return ctx.anthropic_base_url
    if api == "google-generative-ai":
        return f"{ctx.gemini_base_url}/v1beta"
    return ctx.openai_base_url


def models_json(ctx: HarnessContext, api: str, version: str) -> bytes:
    key = KEY_ENV if is_legacy(version) else f"${KEY_ENV}"
    provider = {"baseUrl": base_url(ctx, api), "api": api, "apiKey": key}
    provider["models"] = [{"id": ctx.agent.model}]
    return json_bytes(
        deep_merge({"providers": {PROVIDER: provider}}, ctx.agent.settings.get("config"))
    )


class PiHarness(CliHarness):
    name = "pi"
    package = "@earendil-works/pi-coding-agent"
    default_version = "1.6.0"
    bin = "pi"
    own_paths = (".pi",)
    # pi asks for 16384 output tokens unless a model's maxTokens says otherwise; the
    # models list replaces the preset's, so it names the model (agent.model) again
    config_example = {"providers": {PROVIDER: {"models": [{"id": "polar", "maxTokens": 4096}]}}}
    variants = (
        Variant("openai-completions", "openai_chat"),
        Variant("openai-responses", "openai_responses"),
        Variant("anthropic-messages", "anthropic_messages"),
        Variant("google-generative-ai", "gemini"),
    )

    def package_for(self, version: str) -> str:
        return "@mariozechner/pi-coding-agent" if is_legacy(version) else self.package

    def node_for(self, version: str) -> tuple[int, int]:
        return (20, 6) if is_legacy(version) else (22, 19)

    def session_env(self, ctx: HarnessContext, variant: Variant) -> dict[str, str]:
        return {"PI_OFFLINE": "1", "PI_TELEMETRY": "0", "PI_SKIP_VERSION_CHECK": "1"}

    def config_files(self, ctx: HarnessContext, variant: Variant) -> dict[str, bytes]:
        version = str(self.version(ctx))
        return {".pi/agent/models.json": models_json(ctx, variant.cli_name, version)}

    def command(self, ctx: HarnessContext, variant: Variant) -> tuple[list[str], list[str]]:
        options = ["-p", "--offline", "--no-session", "--provider", PROVIDER]
        return [*options, "--model", ctx.agent.model], [ctx.instruction]

    def judge(self, exit_code: int | None, stdout: str, stderr: str) -> tuple[Outcome, str | None]:
        outcome, reason = super().judge(exit_code, stdout, stderr)
        if outcome == Outcome.COMPLETED and not stdout.strip():
            return Outcome.ERROR, "pi exited 0 without an answer: its model call failed"
        return outcome, reason
