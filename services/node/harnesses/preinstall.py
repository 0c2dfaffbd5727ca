"""Fill a CLI cache ahead of time: ``python -m services.node.harnesses.preinstall``.

For a node (so no INIT ever waits for npm), for CI, or to build a directory to mount
read-only into containers (``agent.settings.install_dir``). Installs each named preset
at its pinned version (``name@version`` for another) and the Node 22 those that need it
run on, two at a time, and prints what it took.

    python -m services.node.harnesses.preinstall --cache .state/harness-cache
    python -m services.node.harnesses.preinstall codex pi@0.73.1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from services.node.harnesses.install import CACHE_ENV
from services.node.harnesses.npm import Installed, ensure_installed, node_package


def wanted(names: list[str]):
    """(preset, NpmPackage, needed Node) for each ``name`` or ``name@version``."""
    from services.node.harnesses import CLI_PRESETS

    out = []
    for item in names or list(CLI_PRESETS):
        name, _, version = item.partition("@")
        if name not in CLI_PRESETS:
            raise SystemExit(f"unknown preset {name!r}: use one of {', '.join(CLI_PRESETS)}")
        preset = CLI_PRESETS[name]()
        version = version or preset.default_version
        out.append((name, preset.npm_package(version), preset.node_for(version)))
    return out


async def preinstall(cache: Path, names: list[str], parallel: int = 2) -> list[Installed]:
    """Every named CLI in ``cache`` (installed or found), Node 22 first when one needs it."""
    items = wanted(names)
    done: list[Installed] = []
    node = None
    if any(need >= (22, 0) for _, _, need in items):
        node = await ensure_installed(cache, node_package())
        done.append(node)
    gate = asyncio.Semaphore(parallel)

    async def one(pkg, need) -> Installed:
        prefix = [str(Path(node.path).parent)] if node and need >= (22, 0) else None
        async with gate:
            return await ensure_installed(cache, pkg, path_prefix=prefix)

    done += await asyncio.gather(*(one(pkg, need) for _, pkg, need in items))
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("presets", nargs="*", help="preset or preset@version (default: all)")
    parser.add_argument("--cache", default=os.environ.get(CACHE_ENV), help=f"${CACHE_ENV}")
    parser.add_argument("--parallel", type=int, default=2)
    args = parser.parse_args(argv)
    if not args.cache:
        parser.error(f"--cache (or ${CACHE_ENV}) is required")
    for got in asyncio.run(preinstall(Path(args.cache).absolute(), args.presets, args.parallel)):
        state = "cached" if got.cached else "installed"
        print(f"{got.package.spec:45} {state:9} {got.seconds:6.1f}s  {got.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
