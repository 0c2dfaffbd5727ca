"""Where a session's CLI comes from, and how it lands on the session's PATH.

Three sources, in this order:

1. ``agent.settings.install_dir``: CLIs pre-installed in the cache layout (``npm.py``),
   e.g. a read-only mount into a container. Nothing is installed; the paths are checked.
2. A local runtime: the node's shared cache (``$POLAR_HARNESS_CACHE``, else
   ``<work_dir>/harness-cache``), filled by npm on the node once per package@version.
   The sandbox sees it read-only (bubblewrap binds it back read-only).
3. Any other runtime: npm inside the sandbox, into the session's HOME (needs npm in the
   image and network; slow, every session downloads).

Whatever the source, INIT links the executables into ``$HOME/.polar/bin``: the run puts
that directory first on PATH, so ``node`` is the one the CLI needs.
"""

from __future__ import annotations

import os
import posixpath
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from services.node.harnesses.base import HarnessContext
from services.node.harnesses.npm import (
    NPM_FLAGS,
    Installed,
    InstallError,
    NpmPackage,
    ensure_installed,
    host_node_version,
    node_package,
    node_version,
)

CACHE_ENV = "POLAR_HARNESS_CACHE"


def bin_dir(ctx: HarnessContext) -> str:
    return posixpath.join(ctx.home, ".polar", "bin")


@dataclass(frozen=True)
class Request:
    package: NpmPackage
    node_min: tuple[int, int]  # the Node (major, minor) the CLI needs; (0, 0): any
    timeout: float


@dataclass(frozen=True)
class Provided:
    cli: Installed
    node: Installed | None  # None: the sandbox's own node is used
    source: str  # install_dir | node_cache | sandbox


def node_cache_dir(runtime) -> Path | None:
    """The node's shared install cache, for runtimes whose files are this node's files."""
    from services.runtimes.local_backend import LocalSandboxRuntime

    if not isinstance(runtime, LocalSandboxRuntime):
        return None
    configured = os.environ.get(CACHE_ENV)
    if configured:
        cache = Path(configured).absolute()
    else:  # session dirs live in <work_dir>/sessions/<runtime_id>
        cache = runtime.session_dir.parent.parent / "harness-cache"
    return cache  # a sandbox sees it read-only wherever it is (services/runtimes/bwrap.py)


async def provide(runtime, ctx: HarnessContext, req: Request) -> Provided:
    install_dir = ctx.agent.settings.get("install_dir")
    if install_dir:
        outcome = await _preinstalled(runtime, str(install_dir), req)
    elif (cache := node_cache_dir(runtime)) is not None:
        outcome = await _node_cache(cache, req)
    else:
        outcome = await _in_sandbox(runtime, ctx, req)
    await _link(runtime, ctx, outcome)
    return outcome


async def _node_cache(cache: Path, req: Request) -> Provided:
    node = None
    if req.node_min > (0, 0) and await host_node_version() < req.node_min:
        node = await ensure_installed(cache, node_package(), timeout=req.timeout)
    prefix = [str(Path(node.path).parent)] if node else None
    cli = await ensure_installed(cache, req.package, path_prefix=prefix, timeout=req.timeout)
    return Provided(cli, node, "node_cache")


async def _preinstalled(runtime, root: str, req: Request) -> Provided:
    t0 = time.monotonic()
    cli = Installed(req.package, req.package.bin_path(root), True, 0.0)
    node = None
    if req.node_min > (0, 0) and await _sandbox_node_version(runtime) < req.node_min:
        pkg = node_package()
        node = Installed(pkg, pkg.bin_path(root), True, 0.0)
    for item in (cli, node):
        if item is not None:
            found = await runtime.exec(["test", "-x", item.path], timeout=30)
            if not found.ok:
                raise InstallError(f"{item.package.spec} is not pre-installed at {item.path}")
    seconds = time.monotonic() - t0
    return Provided(Installed(cli.package, cli.path, True, seconds), node, "install_dir")


async def _in_sandbox(runtime, ctx: HarnessContext, req: Request) -> Provided:
    root = posixpath.join(ctx.home, ".polar", "npm")
    node = None
    if req.node_min > (0, 0) and await _sandbox_node_version(runtime) < req.node_min:
        node = await _sandbox_npm(runtime, root, node_package(), None, req.timeout)
    prefix = posixpath.dirname(node.path) if node else None
    cli = await _sandbox_npm(runtime, root, req.package, prefix, req.timeout)
    return Provided(cli, node, "sandbox")


async def _sandbox_npm(runtime, root: str, pkg: NpmPackage, path_prefix, timeout) -> Installed:
    t0 = time.monotonic()
    prefix = posixpath.join(root, pkg.slug)
    path = f'export PATH={shlex.quote(path_prefix)}:"$PATH"; ' if path_prefix else ""
    flags = " ".join(NPM_FLAGS)
    what = shlex.quote(pkg.source or pkg.spec)
    cmd = f"{path}npm install --prefix {shlex.quote(prefix)} {flags} {what}"
    done = await runtime.exec(["sh", "-c", cmd], timeout=timeout)
    if not done.ok:
        err = done.stderr.decode("utf-8", "replace").strip()[-1500:]
        raise InstallError(f"npm install {pkg.spec} in the sandbox failed: {err}")
    return Installed(pkg, pkg.bin_path(root), False, time.monotonic() - t0)


async def _sandbox_node_version(runtime) -> tuple[int, int]:
    done = await runtime.exec(["sh", "-c", "node --version 2>/dev/null || true"], timeout=30)
    return node_version(done.stdout.decode("utf-8", "replace"))


async def _link(runtime, ctx: HarnessContext, outcome: Provided) -> None:
    target = bin_dir(ctx)
    links = [(outcome.cli.path, outcome.cli.package.bin)]
    if outcome.node is not None:
        links.append((outcome.node.path, "node"))
    cmd = f"mkdir -p {shlex.quote(target)}"
    for src, name in links:
        cmd += f" && ln -sfn {shlex.quote(src)} {shlex.quote(posixpath.join(target, name))}"
    done = await runtime.exec(["sh", "-c", cmd], timeout=30)
    if not done.ok:
        raise InstallError(f"cannot link the CLI into {target}: {done.stderr[-500:]!r}")
