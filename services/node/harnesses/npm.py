"""npm packages of harness CLIs, installed once per node into a shared cache.

Layout of a cache directory (the node's, or a read-only mount of pre-installed CLIs)::

    <cache>/<slug>/node_modules/.bin/<bin>     one directory per package@version
    <cache>/<slug>/.polar-installed.json       written last: the install is complete
    <cache>/.locks/<slug>.lock                 concurrent INITs wait here for one install

An install goes to a temporary directory first and is renamed into place, so a session
never sees a half-installed CLI and a crashed install leaves nothing that looks done.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import orjson

MARKER = ".polar-installed.json"
EXACT_VERSION = re.compile(r"^\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?$")
NODE_VERSION = "22.23.3"  # Node from the npm registry (package `node`), for CLIs that need 22
NPM_FLAGS = (
    "--no-audit",
    "--no-fund",
    "--no-save",
    "--no-package-lock",
    "--prefer-offline",
    "--loglevel=error",
)


class InstallError(RuntimeError):
    """A CLI could not be installed (npm missing or failing, a bad version)."""


@dataclass(frozen=True)
class NpmPackage:
    name: str  # e.g. @openai/codex
    version: str  # exact
    bin: str  # the executable it puts in node_modules/.bin
    source: str | None = None  # a tarball or mirror URL to install instead of the registry's

    @property
    def slug(self) -> str:
        """A directory name: no '@' (npm misreads prefixes that look like specs)."""
        return f"{self.name.lstrip('@').replace('/', '+')}-{self.version}"

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}"

    def bin_path(self, root: str | Path) -> str:
        return f"{root}/{self.slug}/node_modules/.bin/{self.bin}"


def node_package(version: str = NODE_VERSION) -> NpmPackage:
    return NpmPackage("node", version, "node")


@dataclass(frozen=True)
class Installed:
    package: NpmPackage
    path: str  # the executable
    cached: bool  # found in the cache: nothing was downloaded
    seconds: float


def is_exact(version: str) -> bool:
    return bool(EXACT_VERSION.match(version))


def npm_env(path_prefix: list[str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(NO_UPDATE_NOTIFIER="1", NPM_CONFIG_UPDATE_NOTIFIER="false")
    if path_prefix:
        env["PATH"] = os.pathsep.join([*path_prefix, env.get("PATH", "")])
    return env


async def run_npm(
    args: list[str], *, env: Mapping[str, str], timeout: float, cwd: str | None = None
) -> str:
    """Run npm on this node; its stdout, or InstallError with the tail of its stderr."""
    npm = shutil.which("npm", path=env.get("PATH"))
    if npm is None:
        raise InstallError("npm is not installed on this node: install Node.js with npm")
    proc = await asyncio.create_subprocess_exec(
        npm,
        *args,
        env=dict(env),
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except (TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        await proc.wait()
        raise InstallError(f"npm {' '.join(args[:2])} timed out after {timeout:.0f}s") from None
    if proc.returncode != 0:
        tail = err.decode("utf-8", "replace").strip()[-1500:]
        raise InstallError(f"npm {' '.join(args[:2])} failed ({proc.returncode}): {tail}")
    return out.decode("utf-8", "replace")


async def resolve_version(name: str, spec: str, timeout: float = 60.0) -> str:
    """An exact version for a range or tag (``latest``, ``^1.2``): asks the registry."""
    if is_exact(spec):
        return spec
    try:
        out = await run_npm(
            ["view", f"{name}@{spec}", "version", "--json"], env=npm_env(), timeout=timeout
        )
    except InstallError as e:
        if "E404" in str(e) and "No match found" in str(e):
            raise InstallError(f"no version of {name} matches {spec!r}") from None
        raise
    try:
        found = orjson.loads(out) if out.strip() else None
    except orjson.JSONDecodeError:
        found = None
    versions = found if isinstance(found, list) else [found] if isinstance(found, str) else []
    versions = [str(v) for v in versions if is_exact(str(v))]
    if not versions:
        raise InstallError(f"no version of {name} matches {spec!r}")
    # the registry lists matches in no promised order (0.73.1 came before 0.73.0)
    return max(versions, key=version_key)


def version_key(version: str) -> tuple:
    """Semver order: numbers numerically, a release after its pre-releases."""
    core, _, pre = version.partition("+")[0].partition("-")
    numbers = tuple(int(x) for x in core.split("."))
    if not pre:
        return (numbers, 1, ())
    parts = tuple((0, int(x), "") if x.isdigit() else (1, 0, x) for x in pre.split("."))
    return (numbers, 0, parts)


@contextlib.asynccontextmanager
async def file_lock(path: Path, timeout: float) -> AsyncIterator[None]:
    """An exclusive lock across processes (and across tasks of this one), polled so the
    event loop never blocks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise InstallError(f"waited {timeout:.0f}s for {path.name}") from None
                await asyncio.sleep(0.2)
        yield
    finally:
        os.close(fd)  # releases the lock


def installed(cache: Path, pkg: NpmPackage) -> bool:
    return (cache / pkg.slug / MARKER).is_file()


async def ensure_installed(
    cache: Path,
    pkg: NpmPackage,
    *,
    path_prefix: list[str] | None = None,
    timeout: float = 900.0,
) -> Installed:
    """``pkg`` in ``cache``, installing it unless it is there. Concurrent callers (other
    sessions, other processes of the node) wait for one install and share it."""
    t0 = time.monotonic()
    if installed(cache, pkg):
        return Installed(pkg, pkg.bin_path(cache), True, time.monotonic() - t0)
    async with file_lock(cache / ".locks" / f"{pkg.slug}.lock", timeout):
        if installed(cache, pkg):  # another session installed it while this one waited
            return Installed(pkg, pkg.bin_path(cache), True, time.monotonic() - t0)
        await _install(cache, pkg, path_prefix, timeout)
    return Installed(pkg, pkg.bin_path(cache), False, time.monotonic() - t0)


async def _install(cache: Path, pkg: NpmPackage, path_prefix, timeout: float) -> None:
    target = cache / pkg.slug
    tmp = cache / f".tmp-{pkg.slug}-{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)
    try:
        (tmp / "package.json").write_text('{"private": true}\n')
        args = ["install", "--prefix", str(tmp), *NPM_FLAGS, pkg.source or pkg.spec]
        await run_npm(args, env=npm_env(path_prefix), timeout=timeout, cwd=str(tmp))
        if not (tmp / "node_modules" / ".bin" / pkg.bin).exists():
            raise InstallError(f"{pkg.spec} installed no `{pkg.bin}` executable")
        meta = {"package": pkg.name, "version": pkg.version, "bin": pkg.bin, "ts": time.time()}
        (tmp / MARKER).write_bytes(orjson.dumps(meta))
        shutil.rmtree(target, ignore_errors=True)  # an unfinished install of a dead process
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def node_version(version_output: str) -> tuple[int, int]:
    """(22, 23) for ``v22.23.3``; (0, 0) when the output is no Node version."""
    m = re.match(r"\s*v?(\d+)\.(\d+)\.", version_output)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


async def host_node_version() -> tuple[int, int]:
    """The version of the ``node`` on this node's PATH ((0, 0): none)."""
    node = shutil.which("node")
    if node is None:
        return (0, 0)
    proc = await asyncio.create_subprocess_exec(
        node, "--version", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    out, _ = await proc.communicate()
    return node_version(out.decode())
