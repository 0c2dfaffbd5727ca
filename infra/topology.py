"""``topology.yaml``: what the dev stack runs and where. Every key is optional.

A missing file means all defaults; an unknown key anywhere is an error that names it
(a typo must never be silently ignored). See ``topology.example.yaml``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import yaml

from infra.catalog import NODE_FIELDS, SERVICES, ServiceKind
from schemas.topology import Backend, NodeBounds
from services.common.settings import DEFAULT_NATS_URL, DEFAULT_REDIS_URL, Retention

DEFAULT_FILE = "topology.yaml"


class TopologyError(ValueError):
    pass


class _Strict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class Node(NodeBounds, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str  # the node's name (in subjects and keys: no dots or spaces)


class ServiceEntry(_Strict):
    enabled: bool = True  # false: `polar up` does not start it
    port: int | None = None  # None: the catalog's default; 0: any free port
    config: dict[str, Any] = {}  # passed through to the service's POLAR_CONFIG


class Topology(_Strict):
    # the stack's NATS (`polar up` starts one there when none answers)
    nats_url: str = DEFAULT_NATS_URL
    redis_url: str = DEFAULT_REDIS_URL  # the stack's Redis or Valkey (likewise)
    nats_replicas: int = 1  # each stream's copies: 3 on a 3-node JetStream cluster
    retention: Retention = Retention()  # what is kept how long (docs/configuration.md)
    state_dir: str = ".state"  # relative paths are under the current directory
    host: str = "127.0.0.1"  # where services listen
    # how long `polar up` waits for every service to be healthy
    startup_timeout_seconds: float = 60.0
    services: dict[str, ServiceEntry] = {}  # absent: every catalog service, enabled
    # the nodes, by name or with their bounds; per-node services run once on each
    nodes: list[str | Node] = msgspec.field(default_factory=lambda: ["node0"])
    backends: list[Backend] = []  # the inference servers; none: the embedded model server (`model`)


class ServicePlan(msgspec.Struct, frozen=True, kw_only=True):
    """One process ``polar up`` starts."""

    name: str  # instance name: the service, or "<service>-<node>" for per-node ones
    service: str  # the catalog row
    port: int  # 0: pick a free port at start
    config: dict[str, Any]


def parse_topology(
    raw: bytes | str, source: str = "topology", catalog: dict[str, ServiceKind] = SERVICES
) -> Topology:
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise TopologyError(f"{source}: not valid YAML: {exc}") from None
    try:
        topo = msgspec.convert(data or {}, Topology)
    except msgspec.ValidationError as exc:
        raise TopologyError(f"{source}: {exc}") from None
    check_topology(topo, source, catalog)
    return topo


def load_topology(path: str | Path | None = None) -> Topology:
    """The topology in ``path``; with no path, ``./topology.yaml`` if present, else defaults."""
    if path is None:
        path = Path(DEFAULT_FILE)
        if not path.exists():
            return Topology()
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TopologyError(f"cannot read topology {path}: {exc.strerror}") from None
    return parse_topology(raw, str(path))


def node_specs(topo: Topology) -> list[Node]:
    return [Node(name=n) if isinstance(n, str) else n for n in topo.nodes]


def check_topology(
    topo: Topology, source: str = "topology", catalog: dict[str, ServiceKind] = SERVICES
) -> None:
    unknown = sorted(set(topo.services) - set(catalog))
    if unknown:
        raise TopologyError(
            f"{source}: unknown service(s) {unknown} under `services`; known: {sorted(catalog)}"
        )
    names = [n.name for n in node_specs(topo)]
    if not names:
        raise TopologyError(f"{source}: `nodes` must name at least one node")
    if len(set(names)) != len(names):
        raise TopologyError(f"{source}: duplicate node names in `nodes`: {names}")


def _taken(kind: ServiceKind, topo: Topology, node: Node) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in kind.takes:
        if field in NODE_FIELDS:
            out[field] = getattr(node, field)
        elif field == "backends":
            out[field] = msgspec.to_builtins(topo.backends)
    return out


def service_config(
    kind: ServiceKind, entry: ServiceEntry, topo: Topology, node: Node, port: int
) -> dict[str, Any]:
    """A service's POLAR_CONFIG: the fields it takes, its own config, then what the
    stack decides (URLs, host, port, node), which nothing overrides."""
    return {
        **_taken(kind, topo, node),
        **entry.config,
        "nats_url": topo.nats_url,
        "redis_url": topo.redis_url,
        "nats_replicas": topo.nats_replicas,
        "retention": msgspec.to_builtins(topo.retention),
        "host": topo.host,
        "port": port,
        "node": node.name,
    }


def plan_services(topo: Topology, catalog: dict[str, ServiceKind] = SERVICES) -> list[ServicePlan]:
    """Every enabled service instance, in catalog order, with its port and config."""
    nodes = node_specs(topo)
    plans = []
    for service, kind in catalog.items():
        if kind.opt_in and service not in topo.services:
            continue
        entry = topo.services.get(service, ServiceEntry())
        if not entry.enabled:
            continue
        base = kind.port if entry.port is None else entry.port
        targets = list(enumerate(nodes)) if kind.per_node else [(0, nodes[0])]
        for i, node in targets:
            port = base + i if base else 0
            name = f"{service}-{node.name}" if kind.per_node else service
            cfg = service_config(kind, entry, topo, node, port)
            plans.append(ServicePlan(name=name, service=service, port=port, config=cfg))
    return plans
