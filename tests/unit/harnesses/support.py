"""A session context for preset tests, and a tiny npm package standing in for a CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from schemas import AgentSpec
from services.node.harnesses.base import HarnessContext

TOKEN = "ps_test-token"
PROXY = "http://127.0.0.1:8200"


def context(tmp: Path | str = "/s", **agent) -> HarnessContext:
    root = Path(tmp)
    home = str(root / "home")
    return HarnessContext(
        session_id="t-0000",
        task_id="t",
        attempt=0,
        instruction="Fix the bug.",
        token=TOKEN,
        proxy_url=PROXY,
        agent=AgentSpec(harness=agent.pop("harness", "noop"), model="m-1", **agent),
        workdir=str(root / "workdir"),
        home=home,
        log_dir=f"{home}/.polar/logs",
        artifact_dir=f"{home}/.polar/artifacts",
    )


FAKE_CLI = """#!/usr/bin/env node
// Prints what a harness CLI would see: its argv, cwd, key and PATH head.
console.log(JSON.stringify({
  argv: process.argv.slice(2), cwd: process.cwd(), key: process.env.OPENAI_API_KEY,
  path0: process.env.PATH.split(":")[0], extra: process.env.EXTRA || null,
}));
"""


def fake_cli_tarball(dest: Path, version: str = "1.0.0") -> Path:
    """An npm tarball of a package with one executable, ``fakecli`` (npm pack: offline)."""
    src = dest / f"fakecli-src-{version}"
    src.mkdir(parents=True)
    meta = {"name": "polar-fake-cli", "version": version, "bin": {"fakecli": "cli.js"}}
    (src / "package.json").write_text(json.dumps(meta))
    (src / "cli.js").write_text(FAKE_CLI)
    (src / "cli.js").chmod(0o755)
    out = subprocess.run(
        ["npm", "pack", "--silent", "--pack-destination", str(dest)],
        cwd=src,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return dest / out.stdout.strip().splitlines()[-1]
