"""Hosts as network namespaces on this machine, joined by one veth bridge.

Only what this module creates is touched: namespaces and links are named with a prefix
unique to this process (``pc<pid>``), and ``Net.close`` removes all of them (also after
a failed test). The test driver reaches every host through the bridge's own address;
the namespaces have no default route, so their traffic stays on the bridge.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from infra import localservers
from infra.catalog import SERVICES


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@dataclass
class Host:
    name: str
    ns: str
    addr: str
    veth: str  # the bridge-side end: down = this host is cut off

    @property
    def wrap(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


@dataclass
class Net:
    prefix: str = field(default_factory=lambda: f"pc{os.getpid() % 100000}")
    hosts: dict[str, Host] = field(default_factory=dict)
    subnet: int = field(default_factory=lambda: 100 + os.getpid() % 150)

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    @property
    def gateway(self) -> str:
        return f"10.213.{self.subnet}.1"

    def open(self) -> Net:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        return self

    def add(self, name: str) -> Host:
        n = len(self.hosts) + 2
        ns, veth, peer = f"{self.prefix}{name}", f"{self.prefix}{name}h", f"{self.prefix}{name}n"
        host = Host(name, ns, f"10.213.{self.subnet}.{n}", veth)
        ip("netns", "add", ns)
        self.hosts[name] = host
        ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        ip("link", "set", peer, "netns", ns)
        ip("link", "set", veth, "master", self.bridge)
        ip("link", "set", veth, "up")
        run = [*host.wrap, "ip"]
        subprocess.run([*run, "link", "set", "lo", "up"], check=True)
        subprocess.run([*run, "addr", "add", f"{host.addr}/24", "dev", peer], check=True)
        subprocess.run([*run, "link", "set", peer, "up"], check=True)
        return host

    def cut(self, name: str) -> None:
        ip("link", "set", self.hosts[name].veth, "down")

    def restore(self, name: str) -> None:
        ip("link", "set", self.hosts[name].veth, "up")

    def close(self) -> None:
        for host in self.hosts.values():
            ip("netns", "pids", host.ns, check=False)
            for pid in ip("netns", "pids", host.ns, check=False).stdout.split():
                localservers.stop_process(int(pid), timeout=2.0)
            ip("netns", "del", host.ns, check=False)
        ip("link", "del", self.bridge, check=False)


class NsService:
    """A Polar service process (as ``polar serve`` runs it) inside a host's namespace."""

    def __init__(self, host: Host, service: str, config: dict, log_dir: Path, port: int) -> None:
        self.host, self.service, self.port = host, service, port
        self.kind = SERVICES[service]
        self.config = {**config, "host": host.addr, "port": port}
        self.log = log_dir / f"{host.name}-{service}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host.addr}:{self.port}"

    def start(self) -> NsService:
        env = {**os.environ, "POLAR_CONFIG": json.dumps(self.config)}
        code = (
            "from infra.serve import serve_app; "
            f"serve_app({self.kind.target!r}, {self.host.addr!r}, {self.port}, "
            f"native={self.kind.native})"
        )
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [*self.host.wrap, sys.executable, "-c", code],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_healthy(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.service}@{self.host.name} exited: {self.tail()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=0.5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.service}@{self.host.name} not healthy: {self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            localservers.stop_process(self.proc.pid, timeout=3.0)
