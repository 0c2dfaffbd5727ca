"""Where the CLI finds things: the topology and the running stack's record.

A running stack's record (``<state_dir>/stack.json``) is the truth for URLs and ports;
without one the CLI falls back to the topology.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from infra import credentials
from infra.credentials import Credentials
from infra.devstack import state_dir_of
from infra.stackstate import Proc, StackState, read_state
from infra.topology import Topology, load_topology, plan_services
from services.common.settings import ENV_TOKENS

SERVERS = ("nats", "redis")
# the options every command that reaches the stack takes
TopologyOpt = Annotated[
    Path | None,
    typer.Option(
        "--topology",
        "-t",
        envvar="POLAR_TOPOLOGY",
        help="topology.yaml (default: ./topology.yaml if present)",
    ),
]
StateDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        help="where the stack keeps its record, logs and data (default: the topology's)",
    ),
]


class Unreachable(RuntimeError):
    """A server or service the command needs does not answer."""


@dataclass(frozen=True)
class Stack:
    topology: Topology
    state_dir: Path
    state: StackState | None

    @classmethod
    def load(cls, topology: Path | None, state_dir: Path | None) -> Stack:
        topo = load_topology(topology)
        where = state_dir.resolve() if state_dir else state_dir_of(topo)
        return cls(topo, where, read_state(where))

    def _proc(self, name: str) -> Proc | None:
        return self.state.get(name) if self.state else None

    @property
    def credentials(self) -> Credentials | None:
        """What ``polar up`` generated for this stack (None: not started by ``polar up``)."""
        return credentials.load(self.state_dir) if self.state else None

    @property
    def nats_url(self) -> str:
        p = self._proc("nats")
        url = p.url if p else self.topology.nats_url
        return self.credentials.nats_url(url) if self.credentials else url

    @property
    def redis_url(self) -> str:
        p = self._proc("redis")
        url = p.url if p else self.topology.redis_url
        return self.credentials.redis_url(url) if self.credentials else url

    @property
    def admin_token(self) -> str | None:
        """The operator's token for the scheduler's and the proxy's admin routes: the one
        ``polar up`` generated, else ``POLAR_ADMIN_TOKEN`` (a deployment's, as its
        services take it)."""
        if self.credentials:
            return self.credentials.admin_token
        return os.environ.get(ENV_TOKENS["admin_token"]) or None

    def services(self) -> list[tuple[str, str, Proc | None]]:
        """(instance name, base URL, its record) for each service of the stack."""
        if self.state is not None:
            return [(p.name, p.url, p) for p in self.state.procs if p.name not in SERVERS]
        host = "127.0.0.1" if self.topology.host in ("0.0.0.0", "") else self.topology.host
        return [
            (p.name, f"http://{host}:{p.port}", None)
            for p in plan_services(self.topology)
            if p.port
        ]

    def service_url(self, name: str) -> str:
        for instance, url, _ in self.services():
            if instance == name:
                return url
        raise Unreachable(f"no {name!r} service in this stack (is it enabled in the topology?)")
