"""Each preset's per-session config, command line and judgement (no processes)."""

from __future__ import annotations

import json
import tomllib

import pytest

from schemas import Outcome
from services.node.harnesses import CLI_PRESETS, default_registry
from services.node.harnesses.cli import PATH_FIRST
from services.node.harnesses.npm import InstallError
from tests.unit.harnesses.support import PROXY, TOKEN, context

BASE = f"{PROXY}/s/{TOKEN}"


def preset(name: str):
    return default_registry().create(name)


def split(run) -> tuple[str, str, list[str]]:
    """(bin dir, executable, its arguments) of a preset's argv."""
    assert run.argv[:3] == PATH_FIRST
    return run.argv[3], run.argv[4], run.argv[5:]


def test_every_builtin_preset_is_registered():
    assert set(CLI_PRESETS) == {"codex", "claude_code", "gemini_cli", "qwen_code", "opencode", "pi"}
    assert {"shell", "noop", *CLI_PRESETS} == set(default_registry().names())


@pytest.mark.parametrize("name", sorted(CLI_PRESETS))
def test_run_puts_the_session_bin_first_closes_nothing_and_keeps_agent_env_last(name):
    ctx = context(harness=name, args=["--extra-flag"], env={"EXTRA": "1", "OPENAI_API_KEY": "mine"})
    run = preset(name).run(ctx)
    bindir, exe, args = split(run)
    assert bindir == f"{ctx.home}/.polar/bin" and exe == preset(name).bin
    assert run.cwd == ctx.workdir
    assert args[-1] == ctx.instruction and "--extra-flag" in args
    assert args.index("--extra-flag") < args.index(ctx.instruction)
    assert run.env["EXTRA"] == "1" and run.env["OPENAI_API_KEY"] == "mine"
    assert run.env["HOME"] == ctx.home and run.env["NO_UPDATE_NOTIFIER"] == "1"


def test_codex_custom_provider_speaks_responses_with_the_token_from_env():
    h, ctx = preset("codex"), context(harness="codex")
    files = h.config_files(ctx, h.variant(ctx))
    cfg = tomllib.loads(files[".codex/config.toml"].decode())
    assert cfg["model"] == "m-1" and cfg["model_provider"] == "polar"
    provider = cfg["model_providers"]["polar"]
    assert provider == {
        "name": "Polar",
        "base_url": f"{BASE}/v1",
        "env_key": "OPENAI_API_KEY",
        "wire_api": "responses",
    }
    assert cfg["check_for_update_on_startup"] is False and cfg["analytics"]["enabled"] is False
    run = h.run(ctx)
    _, _, args = split(run)
    assert args[:2] == ["exec", "--skip-git-repo-check"]
    assert "--dangerously-bypass-approvals-and-sandbox" in args
    assert args[args.index("-C") + 1] == ctx.workdir and args[-2:] == ["--", ctx.instruction]
    assert run.env["CODEX_HOME"] == f"{ctx.home}/.codex" and run.env["OPENAI_API_KEY"] == TOKEN
    assert h.protocol == "openai_responses"


def test_claude_code_headless_as_root_with_quiet_traffic():
    h, ctx = preset("claude_code"), context(harness="claude_code")
    run = h.run(ctx)
    _, _, args = split(run)
    assert args[:2] == ["-p", "--dangerously-skip-permissions"]
    assert args[args.index("--model") + 1] == "m-1"
    assert run.env["ANTHROPIC_BASE_URL"] == BASE and run.env["ANTHROPIC_API_KEY"] == TOKEN
    assert run.env["IS_SANDBOX"] == "1"
    assert run.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert h.protocol == "anthropic_messages"


def test_gemini_selects_api_key_auth_in_settings_and_merges_user_config():
    h = preset("gemini_cli")
    ctx = context(harness="gemini_cli", settings={"config": {"ui": {"theme": "x"}}})
    settings = json.loads(h.config_files(ctx, h.variant(ctx))[".gemini/settings.json"])
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert settings["privacy"]["usageStatisticsEnabled"] is False
    assert settings["ui"] == {"theme": "x"}
    run = h.run(ctx)
    _, _, args = split(run)
    assert args[args.index("-m") + 1] == "m-1" and "--yolo" in args
    assert args[-2:] == ["-p", ctx.instruction]
    assert run.env["GOOGLE_GEMINI_BASE_URL"] == BASE and run.env["GEMINI_API_KEY"] == TOKEN


@pytest.mark.parametrize(
    ("asked", "cli", "protocol"),
    [
        (None, "openai", "openai_chat"),
        ("openai", "openai", "openai_chat"),
        ("anthropic", "anthropic", "anthropic_messages"),
        ("openai-responses", "openai-responses", "openai_responses"),
        ("openai_responses", "openai-responses", "openai_responses"),  # Polar's name works too
    ],
)
def test_qwen_protocols(asked, cli, protocol):
    h = preset("qwen_code")
    run = h.run(context(harness="qwen_code", protocol=asked))
    _, _, args = split(run)
    assert args[args.index("--auth-type") + 1] == cli and "--yolo" in args
    assert h.protocol == protocol
    assert run.env["OPENAI_BASE_URL"] == f"{BASE}/v1" and run.env["ANTHROPIC_BASE_URL"] == BASE


def test_qwen_settings_turn_off_telemetry_updates_and_auto_memory():
    h, ctx = preset("qwen_code"), context(harness="qwen_code")
    settings = json.loads(h.config_files(ctx, h.variant(ctx))[".qwen/settings.json"])
    assert settings["memory"]["enableManagedAutoMemory"] is False
    assert settings["general"]["enableAutoUpdate"] is False
    assert settings["telemetry"]["enabled"] is False


def test_an_unknown_protocol_is_refused_naming_the_choices():
    with pytest.raises(InstallError, match="openai, anthropic, openai-responses"):
        preset("qwen_code").run(context(harness="qwen_code", protocol="grpc"))
    with pytest.raises(InstallError, match="speaks responses"):
        preset("codex").variant(context(harness="codex", protocol="openai_chat"))


def test_opencode_inline_provider_reads_the_key_from_env():
    h, ctx = preset("opencode"), context(harness="opencode")
    run = h.run(ctx)
    cfg = json.loads(run.env["OPENCODE_CONFIG_CONTENT"])
    provider = cfg["provider"]["polar"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": f"{BASE}/v1", "apiKey": "{env:OPENAI_API_KEY}"}
    assert provider["models"] == {"m-1": {"name": "m-1"}} and cfg["model"] == "polar/m-1"
    _, _, args = split(run)
    assert args[:3] == ["run", "--dir", ctx.workdir] and "--auto" in args
    assert args[args.index("-m") + 1] == "polar/m-1"
    assert run.env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"


@pytest.mark.parametrize(
    ("api", "url", "protocol"),
    [
        ("openai-completions", f"{BASE}/v1", "openai_chat"),
        ("openai-responses", f"{BASE}/v1", "openai_responses"),
        ("anthropic-messages", BASE, "anthropic_messages"),
        ("google-generative-ai", f"{BASE}/v1beta", "gemini"),
    ],
)
def test_pi_models_json_per_api(api, url, protocol):
    h, ctx = preset("pi"), context(harness="pi", protocol=api)
    models = json.loads(h.config_files(ctx, h.variant(ctx))[".pi/agent/models.json"])
    provider = models["providers"]["polar"]
    assert provider == {
        "baseUrl": url,
        "api": api,
        "apiKey": "$OPENAI_API_KEY",
        "models": [{"id": "m-1"}],
    }
    h.run(ctx)
    assert h.protocol == protocol


def test_pi_models_json_merges_the_agents_config():
    """A model's limits (a small engine: ``maxTokens``) come from ``settings.config``."""
    model = {"id": "m-1", "maxTokens": 24, "contextWindow": 32768}
    config = {"providers": {"polar": {"models": [model]}}}
    h, ctx = preset("pi"), context(harness="pi", settings={"config": config})
    models = json.loads(h.config_files(ctx, h.variant(ctx))[".pi/agent/models.json"])
    provider = models["providers"]["polar"]
    assert provider["models"] == [model] and provider["baseUrl"] == f"{BASE}/v1"


def test_pi_before_1_0_is_its_old_package_with_a_plain_key_name():
    h, ctx = preset("pi"), context(harness="pi", version="0.73.1")
    assert h.package_for("0.73.1") == "@mariozechner/pi-coding-agent"
    assert h.package_for("1.6.0") == "@earendil-works/pi-coding-agent"
    assert h.node_for("0.73.1") < (22, 0) <= h.node_for("1.6.0")
    models = json.loads(h.config_files(ctx, h.variant(ctx))[".pi/agent/models.json"])
    assert models["providers"]["polar"]["apiKey"] == "OPENAI_API_KEY"


def test_pi_exit_0_without_an_answer_is_an_error():
    pi = preset("pi")
    assert pi.judge(0, "done.\n", "") == (Outcome.COMPLETED, None)
    outcome, reason = pi.judge(0, "  \n", "")
    assert outcome == Outcome.ERROR and "without an answer" in reason
    assert pi.judge(1, "", "Connection error.\n")[1] == "pi exited with code 1: Connection error."


def test_a_failed_exit_names_the_cli_and_its_last_error_line():
    stderr = (
        "error: unexpected argument '--x' found\n\nUsage: codex exec\n\nFor more, try '--help'.\n"
    )
    outcome, reason = preset("codex").judge(2, "", stderr)
    assert outcome == Outcome.ERROR
    assert reason == "codex exited with code 2: error: unexpected argument '--x' found"
    assert preset("codex").judge(1, "", "boom\n")[1] == "codex exited with code 1: boom"
    assert preset("gemini_cli").judge(41, "", "") == (
        Outcome.ERROR,
        "gemini_cli exited with code 41",
    )


def test_settings_proxy_url_points_the_cli_at_a_gateway():
    ctx = context(harness="claude_code", settings={"proxy_url": "http://gw:1"})
    run = preset("claude_code").run(ctx)
    assert run.env["ANTHROPIC_BASE_URL"] == f"http://gw:1/s/{TOKEN}"


def test_version_is_the_recorded_install_else_the_pin(tmp_path):
    ctx = context(tmp_path, harness="codex", version="latest")
    h = preset("codex")
    assert h.version(context(harness="codex")) == "0.171.0"
    assert h.version(ctx) == "latest"  # nothing installed yet: what was asked for
    record = tmp_path / "home" / ".polar" / "logs" / "harness.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"version": "0.172.1"}))
    assert h.version(ctx) == "0.172.1"


@pytest.mark.parametrize("name", sorted(CLI_PRESETS))
def test_own_paths_are_relative(name):
    paths = preset(name).own_paths
    assert paths and all(not p.startswith("/") for p in paths)
