"""What the npm-installed agent CLIs share: install, per-session config, headless run, judge.

A preset subclass names its package, pinned version, executable and protocols, and says
what differs: the session's env vars, config files (relative to the session's HOME), the
command line. The agent spec overrides the version (``agent.version``), the model name,
the protocol (``agent.protocol``: the CLI's own name for it, or Polar's), extra args
(``agent.args``) and env (``agent.env``, applied last). ``agent.settings``: the keys of
``SETTINGS`` below, each with what it does (the harness reference is written from it).
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
from abc import abstractmethod
from dataclasses import dataclass

import orjson

from services.node.harnesses import install
from services.node.harnesses.base import Harness, HarnessContext, HarnessRun
from services.node.harnesses.npm import InstallError, NpmPackage, resolve_version

RECORD = ".polar/logs/harness.json"  # relative to HOME; collected with the session's logs
# ``agent.settings`` keys the CLI presets read, and what each does: the one source of the
# reference (docs/reference/harnesses.md); a test finds every key the presets read here.
SETTINGS = {
    "config": "merged into the preset's own configuration (its section says which file or "
    "variable, if any): objects merge key by key, anything else replaces, so a list is "
    "given whole",
    "proxy_url": "the proxy as the CLI reaches it (a gateway in between): the session's "
    "base URLs are built on it",
    "install_dir": "a directory of CLIs installed ahead of time in the cache layout "
    "(`python -m services.node.harnesses.preinstall`), e.g. a read-only mount into a "
    "container: checked, nothing installed",
    "install_timeout_seconds": "how long INIT may spend installing the CLI (default 900)",
}
COMMON_ENV = {
    "NO_UPDATE_NOTIFIER": "1",
    "NPM_CONFIG_UPDATE_NOTIFIER": "false",
    "DO_NOT_TRACK": "1",
    "NO_COLOR": "1",
    "CI": "1",
}


@dataclass(frozen=True)
class Variant:
    """One protocol a CLI can speak: its own name for it and Polar's."""

    cli_name: str
    protocol: str  # openai_chat | openai_responses | anthropic_messages | gemini


class CliHarness(Harness):
    calls_model = True
    package: str = ""
    default_version: str = ""
    bin: str = ""
    node_min: tuple[int, int] = (0, 0)  # Node (major, minor) the CLI needs; (0, 0): any
    variants: tuple[Variant, ...] = ()  # the first is the default
    # an ``agent.settings.config`` a user needs to know of, shown (merged) in the reference
    config_example: dict | None = None

    # -- what presets override ------------------------------------------------------------
    def package_for(self, version: str) -> str:
        """The npm package of a version (a CLI that moved keeps working at old versions)."""
        return self.package

    def node_for(self, version: str) -> tuple[int, int]:
        return self.node_min

    def npm_package(self, version: str) -> NpmPackage:
        return NpmPackage(self.package_for(version), version, self.bin)

    def session_env(self, ctx: HarnessContext, variant: Variant) -> dict[str, str]:
        return {}

    def config_files(self, ctx: HarnessContext, variant: Variant) -> dict[str, bytes]:
        """Files to write, by path relative to the session's HOME."""
        return {}

    @abstractmethod
    def command(self, ctx: HarnessContext, variant: Variant) -> tuple[list[str], list[str]]:
        """(options, prompt arguments): ``agent.args`` go between the two."""

    # -- the Harness interface --------------------------------------------------------
    installed_version: str | None = None  # set by install() in the process that ran it

    def version(self, ctx: HarnessContext) -> str | None:
        """The exact version installed for this session (recorded at INIT)."""
        recorded = self.installed_version or read_record(ctx).get("version")
        return str(recorded) if recorded else ctx.agent.version or self.default_version

    async def install(self, runtime, ctx: HarnessContext) -> None:
        variant = self.variant(ctx)  # an unknown protocol fails before any download
        version = await resolve_version(
            self.package_for(ctx.agent.version or self.default_version),
            ctx.agent.version or self.default_version,
        )
        pkg = self.npm_package(version)
        self.installed_version = version
        timeout = float(ctx.agent.settings.get("install_timeout_seconds", 900))
        req = install.Request(pkg, self.node_for(version), timeout)
        got = await install.provide(runtime, ctx, req)
        record = {
            "harness": self.name,
            "package": pkg.name,
            "version": pkg.version,
            "protocol": variant.protocol,
            "cli_protocol": variant.cli_name,
            "source": got.source,
            "cached": got.cli.cached and (got.node is None or got.node.cached),
            "install_seconds": round(got.cli.seconds + (got.node.seconds if got.node else 0), 3),
            "node": got.node.package.version if got.node else "sandbox",
        }
        await runtime.upload_file(posixpath.join(ctx.home, RECORD), orjson.dumps(record))

    async def configure(self, runtime, ctx: HarnessContext) -> None:
        ctx = self.reached(ctx)
        for rel, data in self.config_files(ctx, self.variant(ctx)).items():
            await runtime.upload_file(posixpath.join(ctx.home, rel), data, mode=0o600)

    def run(self, ctx: HarnessContext) -> HarnessRun:
        ctx = self.reached(ctx)
        variant = self.variant(ctx)
        self.protocol = variant.protocol  # read back when the artifacts are collected
        options, prompt = self.command(ctx, variant)
        argv = [*PATH_FIRST, install.bin_dir(ctx), self.bin, *options, *ctx.agent.args, *prompt]
        env = {**ctx.env(), **COMMON_ENV, **self.session_env(ctx, variant), **ctx.agent.env}
        return HarnessRun(argv=argv, env=env, cwd=ctx.workdir)

    # -- helpers ----------------------------------------------------------------------
    def variant(self, ctx: HarnessContext) -> Variant:
        wanted = ctx.agent.protocol
        if wanted is None:
            return self.variants[0]
        for v in self.variants:
            if wanted in (v.cli_name, v.protocol):
                return v
        known = ", ".join(v.cli_name for v in self.variants)
        raise InstallError(f"{self.name} speaks {known}; not {wanted!r}")

    def reached(self, ctx: HarnessContext) -> HarnessContext:
        """The context with ``settings.proxy_url`` (a gateway in between) applied."""
        url = ctx.agent.settings.get("proxy_url")
        return dataclasses.replace(ctx, proxy_url=str(url)) if url else ctx


# sh -c 'export PATH="$0:$PATH"; exec "$@"' BIN_DIR CLI ARGS...: the session's bin
# directory first on whatever PATH the sandbox has, then the CLI replaces the shell.
PATH_FIRST = ["sh", "-c", 'export PATH="$0:$PATH"; exec "$@"']


def read_record(ctx: HarnessContext) -> dict:
    try:
        with open(posixpath.join(ctx.home, RECORD), "rb") as f:
            data = orjson.loads(f.read())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def deep_merge(base: dict, extra: object) -> dict:
    """``extra`` (``agent.settings.config``) merged into ``base``; dicts merge, the rest
    replaces."""
    if not isinstance(extra, dict):
        return base
    out = dict(base)
    for key, value in extra.items():
        old = out.get(key)
        out[key] = deep_merge(old, value) if isinstance(old, dict) else value
    return out


def json_bytes(data: object) -> bytes:
    return json.dumps(data, indent=2).encode() + b"\n"
