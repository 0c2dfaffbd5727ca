"""docs/reference/harnesses.md: what a harness gets, from ``services/node/harnesses/``.

The environment is ``SESSION_ENV``; the settings are ``cli.SETTINGS``; each preset's files,
variables and command line are what the preset itself writes for a sample session, and
where ``agent.settings.config`` lands is found by giving it one and seeing what changed.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from infra.docgen.source import cell, markdown, own_doc
from schemas import AgentSpec
from services.node.harnesses import CLI_PRESETS
from services.node.harnesses.base import SESSION_ENV, HarnessContext
from services.node.harnesses.cli import COMMON_ENV, SETTINGS, CliHarness
from services.node.harnesses.shell import NoopHarness, ShellHarness

EXAMPLE_AGENT = Path(__file__).resolve().parents[1] / "demo" / "agent.py"
_PROBE = "polar-docgen-probe"


def sample(name: str, settings: dict | None = None) -> HarnessContext:
    """A session as the reference shows it: placeholders for what differs per session."""
    return HarnessContext(
        session_id="<session_id>",
        task_id="<task_id>",
        attempt=0,
        instruction="<instruction>",
        token="<token>",
        proxy_url="<proxy>",
        agent=AgentSpec(harness=name, settings=settings or {}),
        workdir="<workdir>",
        home="<home>",
        log_dir="<home>/.polar/logs",
        artifact_dir="<home>/.polar/artifacts",
    )


def written(preset: CliHarness, ctx: HarnessContext) -> dict[str, str]:
    """What the preset puts in place for a session: its files (``~/...``) and the
    variables it adds (``$NAME``)."""
    variant = preset.variant(ctx)
    files = {f"~/{k}": v.decode() for k, v in preset.config_files(ctx, variant).items()}
    env = {f"${k}": v for k, v in preset.session_env(ctx, variant).items()}
    return {**files, **env}


def config_target(preset: CliHarness) -> list[str]:
    """Where ``agent.settings.config`` goes: what changes when it is given."""
    plain = written(preset, sample(preset.name))
    probed = written(preset, sample(preset.name, {"config": {_PROBE: 1}}))
    return [k for k in probed if probed[k] != plain.get(k)]


def _module_doc(cls: type) -> str:
    return markdown(sys.modules[cls.__module__].__doc__ or "").strip()


def _block(text: str) -> list[str]:
    try:
        parsed = json.loads(text)
    except ValueError:
        return ["```", text.rstrip("\n"), "```"]
    return ["```json", json.dumps(parsed, indent=2), "```"]


def environment() -> str:
    out = ["## The environment", "", own_doc(HarnessContext.env), ""]
    out += ["| variable | holds |", "|---|---|"]
    out += [f"| `{v.name}` | {cell(v.doc)} |" for v in SESSION_ENV]
    return "\n".join(out)


def shell() -> str:
    example = ast.get_docstring(ast.parse(EXAMPLE_AGENT.read_text())) or ""
    return "\n".join(
        [
            "## `shell`",
            "",
            own_doc(ShellHarness),
            "",
            "An example agent, `infra/demo/agent.py`: " + markdown(example),
            "",
            "## `noop`",
            "",
            own_doc(NoopHarness),
        ]
    )


def presets_common() -> str:
    out = ["## CLI presets", "", _module_doc(CliHarness), ""]
    out += ["Every preset's run also gets:", ""]
    out += [f"- `{k}={v}`" for k, v in COMMON_ENV.items()]
    out += ["", "`agent.settings` keys:", "", "| key | what it does |", "|---|---|"]
    out += [f"| `{k}` | {cell(v)} |" for k, v in SETTINGS.items()]
    return "\n".join(out)


def preset(cls: type[CliHarness]) -> str:
    p, ctx = cls(), sample(cls.name)
    variants = ", ".join(f"`{v.cli_name}` ({v.protocol})" for v in p.variants)
    need = p.node_for(p.default_version)
    node = "any" if need == (0, 0) else "≥ " + ".".join(map(str, need))
    options, prompt = p.command(ctx, p.variant(ctx))
    out = [f"### `{p.name}`", "", _module_doc(cls), ""]
    out += [
        f"- package: `{p.package}` {p.default_version} (`agent.version` for another)",
        f"- `agent.protocol`: {variants}; the first is the default",
        f"- Node: {node}; its own paths in HOME: " + ", ".join(f"`{x}`" for x in p.own_paths),
        f"- runs: `{' '.join([p.bin, *options, '<agent.args>', *prompt])}`",
        "- `agent.settings.config` is merged into: "
        + (", ".join(f"`{t}`" for t in config_target(p)) or "nothing (this preset reads none)"),
        "",
        f"What it writes for a session (`agent.model` `{ctx.agent.model}`, the default protocol):",
        "",
    ]
    for where, text in written(p, ctx).items():
        if where.startswith("$") and "\n" not in text and not text.startswith("{"):
            out += [f"- `{where[1:]}={text}`"]
        else:
            out += ["", f"`{where}`:", "", *_block(text), ""]
    if p.config_example is not None:
        out += _example(p)
    return "\n".join(out).rstrip() + "\n"


def _example(p: CliHarness) -> list[str]:
    settings = {"config": p.config_example}
    ctx = sample(p.name, settings)
    out = ["For example, `agent.settings`:", "", *_block(json.dumps(settings)), ""]
    for where in config_target(p):
        out += [f"gives `{where}`:", "", *_block(written(p, ctx)[where]), ""]
    return out


def render() -> str:
    parts = [
        "# Harness reference",
        "",
        "What the agent's process gets in every session, and what each harness preset"
        " writes, reads and runs. See docs/harnesses.md for the presets' story and"
        " docs/reference/task.md for `agent` itself.",
        "",
        environment(),
        "",
        shell(),
        "",
        presets_common(),
        "",
        *(preset(cls) for cls in CLI_PRESETS.values()),
    ]
    return "\n".join(parts)
