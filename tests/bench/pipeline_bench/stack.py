"""One checkout's dev stack, started as a user starts it: that tree's own ``polar up``.

The topology asks for its own nats-server and Valkey on free ports, a free port for
every service, no embedded model and no dashboard, one node with the given bounds, and
the proxy in chat mode in front of the instant engine. The tree's code runs (``cwd`` and
``PYTHONPATH`` are the tree), so a baseline checkout is measured with its own services;
its ``stack.json`` and ``credentials.json`` say which processes to watch and how to sign
in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from infra.devstack import client_urls
from tests.bench.proxy_bench.backend import MODEL

SERVER_NAMES = {"nats": "nats-server", "redis": "valkey"}
SERVICES = ("scheduler", "pool", "executor", "builder", "evaluator", "proxy")


def topology(state_dir: Path, engine_url: str, bounds: tuple[int, int, int]) -> dict:
    max_init, ready_buffer, max_run = bounds
    services: dict[str, dict] = {name: {"port": 0} for name in SERVICES}
    services["proxy"]["config"] = {"mode": "chat"}  # the instant engine templates nothing
    services["model"] = {"enabled": False}
    services["dashboard"] = {"enabled": False}
    return {
        "nats_url": "nats://127.0.0.1:0",
        "redis_url": "redis://127.0.0.1:0/0",
        "state_dir": str(state_dir),
        "startup_timeout_seconds": 180,
        "services": services,
        "nodes": [
            {
                "name": "node0",
                "max_init": max_init,
                "ready_buffer": ready_buffer,
                "max_run": max_run,
            }
        ],
        "backends": [{"name": "default", "kind": "sglang", "url": engine_url, "model": MODEL}],
    }


@dataclass
class TreeStack:
    """``label``'s stack (``tree``: the checkout whose ``polar up`` runs)."""

    label: str
    tree: Path
    state_dir: Path
    pids: dict[str, int] = field(default_factory=dict)  # process name -> group leader
    nats_url: str = ""
    redis_url: str = ""

    def _polar(self, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(self.tree)}
        cmd = [sys.executable, "-m", "services.cli.main", *args, "--state-dir", str(self.state_dir)]
        return subprocess.run(cmd, cwd=self.tree, env=env, capture_output=True, text=True)

    def up(self, engine_url: str, bounds: tuple[int, int, int]) -> TreeStack:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        topo = self.state_dir / "topology.yaml"
        topo.write_text(yaml.safe_dump(topology(self.state_dir, engine_url, bounds)))
        done = self._polar("up", "--topology", str(topo))
        if done.returncode != 0:
            raise RuntimeError(f"{self.label}: polar up failed:\n{done.stderr[-3000:]}")
        record = json.loads((self.state_dir / "stack.json").read_text())
        urls = {}
        for proc in record["procs"]:
            name = SERVER_NAMES.get(proc["name"], proc["name"].removesuffix("-node0"))
            self.pids[name] = proc["pid"]
            urls[proc["name"]] = proc["url"]
        self.nats_url, self.redis_url = client_urls(self.state_dir, urls["nats"], urls["redis"])
        return self

    def down(self) -> None:
        if self.pids:
            self._polar("down")
            self.pids.clear()

    def log_dir(self) -> Path:
        return self.state_dir / "logs"
