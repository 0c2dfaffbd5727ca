"""docs/reference/cli.md: every ``polar`` command and its arguments and options, read
from the typer app itself (``services/cli/main.py``), and ``polar model``'s commands
from the embedded engine's own app (``services/engine/cli.py``)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import typer.main

from infra.docgen.source import cell, markdown
from services.cli import main as cli_main


@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]  # ("polar", "credentials", "show")
    command: object  # the click command typer built
    group: bool  # has commands of its own (documented after it)

    @property
    def name(self) -> str:
        return " ".join(self.path)


def _click(app) -> object:
    return typer.main.get_command(app)


def commands() -> list[Command]:
    """Every command, depth first, in the order the app declares them."""
    return list(_walk(("polar",), _click(cli_main.app)))


def _walk(path: tuple[str, ...], cmd) -> Iterator[Command]:
    subs = dict(getattr(cmd, "commands", {}))
    if path == ("polar", "model") and (embedded := cli_main._embedded_app()) is not None:
        subs = dict(_click(embedded).commands)  # `polar model` passes its arguments on
    yield Command(path, cmd, bool(subs))
    for name, sub in subs.items():
        if not getattr(sub, "hidden", False):
            yield from _walk((*path, name), sub)


def params(cmd) -> list:
    return [p for p in cmd.params if not getattr(p, "hidden", False) and p.name != "help"]


def help_text(cmd) -> str:
    return markdown(inspect.cleandoc(cmd.help or ""))


def _context(c: Command):
    ctx_type = type(c.command).context_class
    return ctx_type(c.command, info_name=c.path[-1])


def usage(c: Command) -> str:
    if c.group:
        return f"{c.name} COMMAND [ARGS]..."
    parts = [c.name]
    if any(p.param_type_name == "option" for p in params(c.command)):
        parts.append("[OPTIONS]")
    for p in params(c.command):
        if p.param_type_name == "argument":
            name = p.name.upper() + ("..." if p.nargs == -1 else "")
            parts.append(name if p.required else f"[{name}]")
    return " ".join(parts)


def default_text(p) -> str:
    if p.required:
        return "**required**"
    if p.default is None or (getattr(p, "is_flag", False) and p.default is False):
        return ""
    if getattr(p, "secondary_opts", None):  # --check / --no-check
        return f"`{(p.opts if p.default else p.secondary_opts)[0]}`"
    return f"`{p.default}`"


def param_row(c: Command, p) -> str:
    names = p.get_help_record(_context(c))[0] if p.param_type_name == "option" else p.name.upper()
    text = markdown(p.help or "")
    if p.envvar:
        text += f" (env `{p.envvar}`)"
    return "| " + " | ".join(cell(x) for x in (f"`{names}`", default_text(p), text)) + " |"


def section(c: Command) -> str:
    level = "#" * min(len(c.path) + 1, 4)
    out = [f"{level} `{c.name}`", "", "```", usage(c), "```", ""]
    if text := help_text(c.command):
        out += [text, ""]
    rows = [param_row(c, p) for p in params(c.command)]
    if rows:
        out += ["| argument or option | default | description |", "|---|---|---|", *rows, ""]
    if c.group and c.path != ("polar",):
        subs = [x for x in commands() if x.path[:-1] == c.path]
        out += ["Commands: " + ", ".join(f"`{x.path[-1]}`" for x in subs) + ".", ""]
    return "\n".join(out)


def undocumented() -> list[str]:
    """Each command with no help text, and each argument or option with none."""
    out = []
    for c in commands():
        if not help_text(c.command):
            out.append(c.name)
        out += [f"{c.name} {p.name}" for p in params(c.command) if not (p.help or "").strip()]
    return out


def render() -> str:
    parts = [
        "# CLI reference",
        "",
        "Every `polar` command with its arguments and options, as `polar COMMAND --help`"
        " prints them. Every command that reaches a stack takes `-t / --topology` (or"
        " `$POLAR_TOPOLOGY`, else `./topology.yaml`) and `--state-dir`: see"
        " [the topology reference](topology.md).",
        "",
        *(section(c) for c in commands()),
    ]
    return "\n".join(parts)
