"""Where the CLI finds things: the topology and the running stack's record — the one
path every client command connects by (``polar status | submit | cancel | export |
train``).

1. ``-t topology.yaml`` (or ``$POLAR_TOPOLOGY``, or ``./topology.yaml``) and
   ``--state-dir``: that stack's record (``<state_dir>/stack.json``), the truth for URLs
   and ports, and the credentials ``polar up`` keeps beside it; without a record, the
   topology's URLs.
2. No topology and no running stack in the default state dir: the environment
   (``$POLAR_ENV_FILE``, the ``<state_dir>/polar.env`` that ``polar up`` writes, and the
   ``POLAR_*`` variables: ``services.client.connection``). A file naming a state dir
   whose stack runs here reads that stack as in 1.
3. Else the default topology's URLs.

``Stack.connection()`` is what a client needs (URLs with credentials, tokens, the
services' addresses), the same fields as the environment file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
import typer

from infra import credentials
from infra.credentials import OPERATOR, Credentials
from infra.devstack import state_dir_of
from infra.stackstate import Proc, StackState, read_state
from infra.topology import DEFAULT_FILE, Topology, load_topology, plan_services
from services.client.connection import Connection, from_environment
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
    env: Connection | None = None  # the environment's stack (path 2 of the docstring)

    @classmethod
    def load(
        cls, topology: Path | None, state_dir: Path | None, env: dict[str, str] | None = None
    ) -> Stack:
        topo = load_topology(topology)
        where = state_dir.resolve() if state_dir else state_dir_of(topo)
        state = read_state(where)
        named = topology is not None or state_dir is not None or Path(DEFAULT_FILE).exists()
        if state is None and not named:
            return cls._from_environment(topo, where, env)
        return cls(topo, where, state)

    @classmethod
    def _from_environment(cls, topo: Topology, where: Path, env: dict[str, str] | None) -> Stack:
        conn = from_environment(env)
        if conn.state_dir:
            named = Path(conn.state_dir).resolve()
            if (found := read_state(named)) is not None:
                return cls(topo, named, found)
        return cls(topo, where, None, conn if conn.known else None)

    def _proc(self, name: str) -> Proc | None:
        return self.state.get(name) if self.state else None

    @property
    def credentials(self) -> Credentials | None:
        """What ``polar up`` generated for this stack (None: not started by ``polar up``)."""
        return credentials.load(self.state_dir) if self.state else None

    def nats_url_of(self, user: str = OPERATOR) -> str:
        """The stack's NATS URL as ``user`` signs in (the operator's ``cli`` by default;
        ``polar train`` signs in as ``trainer``)."""
        if self.env is not None:
            return self.env.nats_url or self.topology.nats_url
        p = self._proc("nats")
        url = p.url if p else self.topology.nats_url
        creds = self.credentials
        return creds.nats_url(url, user) if creds else url

    @property
    def nats_url(self) -> str:
        return self.nats_url_of()

    @property
    def redis_url(self) -> str:
        if self.env is not None:
            return self.env.redis_url or self.topology.redis_url
        p = self._proc("redis")
        url = p.url if p else self.topology.redis_url
        return self.credentials.redis_url(url) if self.credentials else url

    @property
    def admin_token(self) -> str | None:
        """The operator's token for the scheduler's and the proxy's admin routes: the one
        ``polar up`` generated, else ``POLAR_ADMIN_TOKEN`` (a deployment's, as its
        services take it)."""
        return self._token("admin_token")

    @property
    def read_token(self) -> str | None:
        return self._token("read_token")

    def _token(self, name: str) -> str | None:
        if self.env is not None:
            return getattr(self.env, name)
        if self.credentials:
            return getattr(self.credentials, name)
        return os.environ.get(ENV_TOKENS[name]) or None

    def services(self) -> list[tuple[str, str, Proc | None]]:
        """(instance name, base URL, its record) for each service of the stack."""
        if self.env is not None:
            known = ("proxy", "scheduler", "dashboard")
            urls = [(name, getattr(self.env, f"{name}_url")) for name in known]
            return [(name, url, None) for name, url in urls if url]
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

    def connection(self, user: str = OPERATOR) -> Connection:
        """What a client of this stack needs, as ``user`` signs in to NATS: the fields of
        the environment file ``polar up`` writes."""
        urls = {name: url for name, url, _ in self.services()}
        return Connection(
            nats_url=self.nats_url_of(user),
            redis_url=self.redis_url,
            admin_token=self.admin_token,
            read_token=self.read_token,
            proxy_url=urls.get("proxy"),
            scheduler_url=urls.get("scheduler"),
            dashboard_url=urls.get("dashboard"),
            state_dir=None if self.env is not None else str(self.state_dir),
        )


# -- a trainer run in the foreground, registered with its stack ----------------------
TRAINER_RECORD = "training.json"  # <state_dir>/training.json: the last `polar train` run


class TrainerRecord(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str
    log_path: str  # its JSONL log (services/trainer/metrics.py), absolute
    checkpoint_dir: str
    pid: int
    started_at: float


def register_trainer(state_dir: Path, record: TrainerRecord) -> Path:
    """Tell the stack's readers (the dashboard's Training page) where a foreground
    ``polar train`` run logs; the last run registered wins."""
    path = Path(state_dir) / TRAINER_RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(record))
    tmp.replace(path)
    return path


def registered_trainer(state_dir: str | Path | None) -> TrainerRecord | None:
    """The last ``polar train`` run registered with the stack in ``state_dir``."""
    if not state_dir:
        return None
    try:
        raw = (Path(state_dir) / TRAINER_RECORD).read_bytes()
        return msgspec.json.decode(raw, type=TrainerRecord)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
