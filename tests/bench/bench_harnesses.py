"""Harness presets: install cold and cached, then every variant through the whole stack.

    python tests/bench/bench_harnesses.py              # cold = empty CLI cache, npm's own
                                                       # download cache kept (~/.npm)
    python tests/bench/bench_harnesses.py --cold-npm   # npm's download cache empty too
    python tests/bench/bench_harnesses.py --no-stack   # installs only

Per variant: INIT seconds (install from the warm node cache, config, git baseline),
harness run seconds, model calls (main + side), and per call the proxy's whole time with
the engine's part (the rest is the proxy: templating, capture, streaming).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.node.harnesses import CLI_PRESETS  # noqa: E402
from services.node.harnesses.preinstall import preinstall  # noqa: E402
from tests.integration.harness_stack import LEGACY_PI, Stack, harness_task  # noqa: E402

VARIANTS = {
    "codex": ("codex", {}),
    "claude_code": ("claude_code", {}),
    "gemini_cli": ("gemini_cli", {}),
    "gemini-router": ("gemini_cli", {"model": "auto"}),
    "qwen-openai": ("qwen_code", {"protocol": "openai"}),
    "qwen-anthropic": ("qwen_code", {"protocol": "anthropic"}),
    "qwen-responses": ("qwen_code", {"protocol": "openai-responses"}),
    "opencode": ("opencode", {}),
    "pi-completions": ("pi", {"protocol": "openai-completions"}),
    "pi-responses": ("pi", {"protocol": "openai-responses"}),
    "pi-anthropic": ("pi", {"protocol": "anthropic-messages"}),
    "pi-google": ("pi", {"protocol": "google-generative-ai"}),
}


async def installs(cache: Path) -> None:
    names = [*CLI_PRESETS, f"pi@{LEGACY_PI}"]
    for label in ("cold", "cached"):
        t0 = time.monotonic()
        got = await preinstall(cache, names)
        print(f"\n== install, {label} cache ({time.monotonic() - t0:.1f}s in all, 2 at a time)")
        for g in got:
            print(f"  {g.package.spec:45} {g.seconds:6.1f}s {'cached' if g.cached else 'npm'}")


async def stack_runs(cache: Path, root: Path, max_run: int) -> None:
    os.environ["POLAR_HARNESS_CACHE"] = str(cache)
    stack = Stack.up(root, max_run=max_run)
    try:
        t0 = time.monotonic()
        tasks = [harness_task(tid, h, **dict(a)) for tid, (h, a) in VARIANTS.items()]
        runs = await stack.run(tasks)
        wall = time.monotonic() - t0
    finally:
        stack.down()
    print(f"\n== {len(runs)} sessions through the stack, {max_run} at a time: {wall:.0f}s")
    print("variant          reward init_s  run_s  calls  proxy ms/call: whole (engine)")
    for tid, run in runs.items():
        ms = run.proxy_ms()
        main = sum(1 for r in run.records if r.side_call is None)
        over = [whole - engine for whole, engine in ms]
        print(
            f"  {tid:16} {run.session.reward!s:>4}"
            f" {run.stage_seconds('INITIALIZING', 'READY')!s:>6}"
            f" {run.stage_seconds('RUNNING', 'POSTRUN')!s:>6}  {main}+{len(run.records) - main}"
            f"    {', '.join(f'{w:.0f} ({e:.0f})' for w, e in ms)}"
            f"   proxy-only median {statistics.median(over) if over else 0:.1f} ms"
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cold-npm", action="store_true", help="empty npm download cache")
    parser.add_argument("--no-stack", action="store_true")
    parser.add_argument("--max-run", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="polar-bench-harness-"))
    if args.cold_npm:
        os.environ["NPM_CONFIG_CACHE"] = str(root / "npm-cache")
    cache = root / "harness-cache"
    asyncio.run(installs(cache))
    if not args.no_stack:
        asyncio.run(stack_runs(cache, root / "stack", args.max_run))
    print(f"\n(files in {root}; remove when done)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
