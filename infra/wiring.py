"""Which address each service of the stack is given (pure: no sockets, no clock).

``polar up`` chooses some addresses itself (``port: 0`` anywhere, a NATS or Redis URL
with port 0) and each choice must reach every service that needs it, or a harness is
sent to whatever listens at a default port:

- NATS and Redis: a URL with an explicit port 0 gets a free port, and every service is
  given the resulting URL (``with_server_ports``);
- each service instance with ``port: 0`` gets a free port (``with_ports``); ``polar up``
  picks the port each had at the stack's last start where it is free
  (``localservers.StickyPorts``), so clients still running find the stack again;
- then ``wire``: pools, executors, evaluators and the trainer (``ServiceKind.proxy_url``)
  get the stack's proxy URL, the first three (``ServiceKind.work_dir``) a ``work_dir``
  under the state dir, the evaluator every node's name (it reaches their runtimes in
  that work dir: ``EvaluatorConfig.nodes``); the proxy and the pools get
  the embedded ``model`` service's URL for every backend without a ``url`` (and the
  proxy its default backend when the topology lists none), and the proxy the model
  service's ``model_dir`` for token mode. What the user set in a service's ``config``
  wins: a gateway in front of the proxy, a shared work dir.

``with_credentials`` hands each service the tokens it checks or presents
(``infra/credentials.py``): the scheduler its admin and read tokens, the proxy its admin
token and the engine key for its backends that are the stack's ``model`` service, the
model service that key (``api_key``), the trainer the admin token it pushes weights with.

``cannot_work`` then refuses, before anything starts, a stack whose proxy could not
serve (token mode with no tokenizer to template with).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec

from infra.catalog import SERVICES, ServiceKind
from infra.credentials import Credentials
from infra.topology import ServicePlan, Topology, node_specs
from proxy.config import ProxyConfig

# a free port for the named thing ("nats", "redis", a service instance): named, so that a
# restart of the same stack can give each the port it had (localservers.StickyPorts)
PickPort = Callable[[str], int]
MODEL, PROXY, TRAINER, DASHBOARD = "model", "proxy", "trainer", "dashboard"
EVALUATOR = "evaluator"


def connect_host(host: str) -> str:
    """Where a client on this machine reaches a service listening on ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def explicit_port(url: str) -> int | None:
    """The port written in ``url`` (``nats://h:0`` -> 0), None when it names none."""
    try:
        return urlsplit(url if "://" in url else f"tcp://{url}").port
    except ValueError:
        return None


def with_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{parts.netloc.rpartition('@')[0]}@" if "@" in parts.netloc else ""
    netloc += f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def with_server_ports(topo: Topology, pick: PickPort) -> Topology:
    """The topology with a free port in each of ``nats_url`` / ``redis_url`` that asks
    for port 0."""
    changes = {
        field: with_port(url, pick(field.removesuffix("_url")))
        for field in ("nats_url", "redis_url")
        if explicit_port(url := getattr(topo, field)) == 0
    }
    return msgspec.structs.replace(topo, **changes) if changes else topo


def with_ports(plans: list[ServicePlan], pick: PickPort) -> list[ServicePlan]:
    """Each plan with port 0 given a free port (in its config too)."""
    out = []
    for p in plans:
        if p.port == 0:
            port = pick(p.name)
            p = msgspec.structs.replace(p, port=port, config={**p.config, "port": port})
        out.append(p)
    return out


def service_url(plans: list[ServicePlan], service: str, host: str) -> str | None:
    """The base URL of ``service`` in this stack (its first instance), None when the
    stack does not run it."""
    port = next((p.port for p in plans if p.service == service), None)
    return None if port is None else f"http://{connect_host(host)}:{port}"


def wire(
    plans: list[ServicePlan],
    topo: Topology,
    state_dir: Path,
    catalog: dict[str, ServiceKind] = SERVICES,
) -> list[ServicePlan]:
    """Every plan's config with the addresses of the services it needs (ports already
    chosen: ``with_ports`` first)."""
    proxy = service_url(plans, PROXY, topo.host)
    model = service_url(plans, MODEL, topo.host)
    model_dir = next((p.config.get("model_dir") for p in plans if p.service == MODEL), None)
    out = []
    for p in plans:
        config = dict(p.config)
        kind = catalog[p.service]
        if kind.proxy_url and proxy:
            config = {"proxy_url": proxy, **config}
        if kind.work_dir:
            config = {"work_dir": str(state_dir / "work"), **config}
        if p.service == EVALUATOR:  # every node is on this machine, in that one work dir
            config = {"nodes": [n.name for n in node_specs(topo)], **config}
        if model is not None:
            config = _embedded_backends(config, p.service, model)
        if p.service == PROXY and model_dir and "model_dir" not in config:
            config = _embedded_model_dir(config, model_dir)
        out.append(msgspec.structs.replace(p, config=config))
    return [_dashboard_sources(p, out, state_dir) if p.service == DASHBOARD else p for p in out]


def _dashboard_sources(plan: ServicePlan, plans: list[ServicePlan], state_dir: Path) -> ServicePlan:
    """What the dashboard reads besides NATS and Redis: the stack's record (the topology
    page), the proxy's tokenizer (token ids decoded) and the trainer's JSONL log."""
    found: dict[str, Any] = {"state_dir": str(state_dir)}
    proxy = next((p.config for p in plans if p.service == PROXY), {})
    if proxy.get("model_dir"):
        found["model_dir"] = proxy["model_dir"]
    elif any(p.service == MODEL for p in plans):  # the embedded engine's default model
        from schemas.engine import DEFAULT_MODEL_DIR

        found["model_dir"] = str(DEFAULT_MODEL_DIR)
    trainer = next((p.config for p in plans if p.service == TRAINER), None)
    if trainer and (trainer.get("log_path") or trainer.get("checkpoint_dir")):
        found["trainer_log"] = trainer.get("log_path") or str(
            Path(trainer["checkpoint_dir"]) / "log.jsonl"
        )
    return msgspec.structs.replace(plan, config={**found, **plan.config})


TOKENS_OF = {  # which stack tokens each service is given (its config may set its own)
    "scheduler": ("admin_token", "read_token"),
    PROXY: ("admin_token",),
    "trainer": ("admin_token",),
    "dashboard": ("admin_token", "read_token"),  # its cancel; every read
}


def with_credentials(
    plans: list[ServicePlan], creds: Credentials, host: str = "127.0.0.1"
) -> list[ServicePlan]:
    """``host``: the stack's (its model service listens there)."""
    model_port = next((p.port for p in plans if p.service == MODEL), None)
    out = []
    for p in plans:
        given = {name: getattr(creds, name) for name in TOKENS_OF.get(p.service, ())}
        config = {**given, **p.config}
        if creds.engine_key and p.service == MODEL:
            config = {"api_key": creds.engine_key, **config}
        if creds.engine_key and p.service == PROXY and model_port is not None:
            config = _keyed_backends(config, host, model_port, creds.engine_key)
        out.append(msgspec.structs.replace(p, config=config) if config != p.config else p)
    return out


_LOCAL = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", ""})


def _keyed_backends(config: dict[str, Any], host: str, port: int, key: str) -> dict[str, Any]:
    """The proxy's backends at the stack's model service (this machine, its port, however
    the URL spells the host) present its key; a key set in ``settings.http`` wins."""

    def at_model(url: Any) -> bool:
        try:
            parts = urlsplit(str(url))
            return parts.port == port and (parts.hostname or "") in _LOCAL | {host}
        except ValueError:
            return False

    def keyed(entry: dict[str, Any]) -> dict[str, Any]:
        settings = entry.get("settings") or {}
        http = {"api_key": key, **(settings.get("http") or {})}
        return {**entry, "settings": {**settings, "http": http}}

    if "backends" in config:
        backends = [keyed(b) if at_model(b.get("url")) else b for b in config["backends"]]
        config = {**config, "backends": backends}
    backend = config.get("backend")
    if isinstance(backend, dict) and any(at_model(u) for u in backend.get("urls") or []):
        config = {**config, "backend": keyed(backend)}
    return config


def _embedded_backends(config: dict[str, Any], service: str, model_url: str) -> dict[str, Any]:
    """Backends without a ``url`` are the stack's model service; so is the proxy's
    default backend when the topology lists none (and its config sets no ``backend``)."""
    if "backends" in config:
        backends = [b if b.get("url") else {**b, "url": model_url} for b in config["backends"]]
        config = {**config, "backends": backends}
    if service == PROXY and not config.get("backends") and "backend" not in config:
        config = {**config, "backend": {"kind": "embedded", "urls": [model_url]}}
    return config


def _embedded_model_dir(config: dict[str, Any], model_dir: str) -> dict[str, Any]:
    """A proxy in front of the embedded engine templates with that engine's model."""
    try:
        kind = msgspec.convert(config, ProxyConfig).engine().kind
    except msgspec.ValidationError:
        return config  # the proxy reports its own bad config
    return {**config, "model_dir": model_dir} if kind == "embedded" else config


def cannot_work(plans: list[ServicePlan]) -> list[str]:
    """Why the planned stack could not serve, each reason saying what to set; empty
    when nothing is known to be wrong."""
    return [why for p in plans if p.service == PROXY and (why := proxy_problem(p.config))]


def proxy_problem(config: dict[str, Any]) -> str | None:
    try:
        cfg = msgspec.convert(config, ProxyConfig)
    except msgspec.ValidationError as exc:
        return f"services.proxy.config: {exc}"
    if cfg.mode not in ("token", "chat"):
        return f"services.proxy.config.mode is {cfg.mode!r}: use token or chat"
    if cfg.mode == "token" and cfg.tokenizer_dir() is None:
        engine = cfg.engine()
        return (
            f"the proxy runs in token mode (the default: it renders the chat template and "
            f"sends token ids), which needs the served model's tokenizer, but its backend "
            f"is {engine.kind} at {', '.join(engine.urls)} and no model_dir is set. Set "
            "services.proxy.config.model_dir to the model's directory (tokenizer.json and "
            "chat template), or services.proxy.config.mode: chat to let the engine template"
        )
    return None
