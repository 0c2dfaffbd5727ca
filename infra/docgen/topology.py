"""docs/reference/topology.md: every key of ``topology.yaml`` (``infra/topology.py``) and
of each service's settings (its config Struct: what ``services.<name>.config`` sets, and
what ``polar serve`` reads from ``POLAR_CONFIG``), from the code.

The services are the catalog's rows (``infra/catalog.py``), each with the comment above
it; a row's config class is the type of its app factory's ``config`` argument.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
from pathlib import Path

from msgspec import inspect as mi

import infra.topology as topology_module
from infra.catalog import SERVICES, ServiceKind
from infra.docgen.source import cell, markdown, module, own_doc
from infra.docgen.structs import Page, section, undocumented, walk
from infra.topology import Topology
from services.common.settings import ServiceSettings
from services.engine.config import ServeConfig

# The model service's factory reads its settings itself (services/engine/main.py's
# service_config): no ``config`` argument to read the class from.
FACTORY_READS = {"model": ServeConfig}
PAGE = Page(elsewhere={})


def config_class(name: str, kind: ServiceKind) -> type:
    """The Struct a service's ``POLAR_CONFIG`` becomes: its factory's ``config``
    annotation, read from the source (importing the factory's module would import all
    of the service: torch for some)."""
    if name in FACTORY_READS:
        return FACTORY_READS[name]
    mod_name, fn = kind.target.split(":")
    spec = importlib.util.find_spec(mod_name)
    assert spec is not None and spec.origin is not None, mod_name
    tree = ast.parse(Path(spec.origin).read_text())
    factory = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fn)
    (arg,) = [a for a in factory.args.args if a.arg == "config"]
    (cls_name,) = [n.id for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)]
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and cls_name in {a.name for a in node.names}:
            return getattr(importlib.import_module(node.module or ""), cls_name)
    raise LookupError(f"{kind.target}: where does {cls_name} come from?")


@functools.cache
def configs() -> dict[str, type]:
    return {name: config_class(name, kind) for name, kind in SERVICES.items()}


def shared_bases() -> list[type]:
    """``ServiceSettings`` and the bases that services share below it (``NodeSettings``)."""
    bases = [ServiceSettings]
    for cls in configs().values():
        for base in cls.__mro__[1:]:
            if issubclass(base, ServiceSettings) and base not in bases:
                bases.append(base)
    return bases


def own_fields(t: mi.StructType) -> list[mi.Field]:
    """A service's fields less those of the bases it shares with others."""
    shared = {
        f.name
        for base in shared_bases()
        if base is not t.cls and issubclass(t.cls, base)
        for f in mi.type_info(base).fields
    }
    return [f for f in t.fields if f.name not in shared]


def catalog_comments() -> dict[str, str]:
    """Each ``SERVICES`` row's comment, by service name."""
    mod = module("infra.catalog")
    for node in mod.tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "SERVICES":
            assert isinstance(node.value, ast.Dict)
            return {
                k.value: " ".join(mod.above(k.lineno))
                for k in node.value.keys
                if isinstance(k, ast.Constant)
            }
    raise LookupError("no SERVICES in infra/catalog.py")


def catalog_table() -> str:
    comments = catalog_comments()
    out = [
        "| service | port | one per node | started | config | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for name, kind in SERVICES.items():
        cls = config_class(name, kind)
        row = (
            f"`{name}`",
            str(kind.port),
            "yes" if kind.per_node else "",
            "when `services` names it" if kind.opt_in else "by default",
            f"[{cls.__name__}](#{cls.__name__.lower()})",
            comments.get(name, ""),
        )
        out.append("| " + " | ".join(cell(x) for x in row) + " |")
    return "\n".join(out)


def _structs() -> tuple[list[mi.StructType], list[mi.StructType], list[mi.StructType]]:
    """The topology's structs, the shared settings', and the services' (with theirs)."""
    topo = walk([Topology])
    shared = walk(shared_bases(), stop=[t.cls for t in topo])
    classes = list(dict.fromkeys(configs().values()))
    services = walk(classes, stop=[t.cls for t in topo + shared])
    return topo, shared, services


def all_structs() -> list[mi.StructType]:
    topo, shared, services = _structs()
    return topo + shared + services


def undocumented_fields() -> list[str]:
    topo, shared, services = _structs()
    missing = undocumented(topo)
    for t in shared + services:
        kept = own_fields(t)
        missing += [x for x in undocumented([t]) if x.split(".", 1)[1] in {f.name for f in kept}]
    return missing


def _service_section(t: mi.StructType, users: list[str]) -> str:
    where = f"`{t.cls.__module__}.{t.cls.__name__}`"
    used = ", ".join(f"`{u}`" for u in users)
    intro = (
        f"{where}: the settings of {used}, set in the topology under"
        f" `services: {{{users[0]}: {{config: ...}}}}`."
        if users
        else where
    )
    text = section(t, PAGE, level=3, fields=own_fields)
    head, rest = text.split("\n", 1)
    return "\n".join([head, "", intro, rest])


def render() -> str:
    topo, shared, services = _structs()
    users: dict[type, list[str]] = {}
    for name, cls in configs().items():
        users.setdefault(cls, []).append(name)
    parts = [
        "# Topology and service configuration reference",
        "",
        markdown(topology_module.__doc__ or "").strip(),
        "",
        "Every command that reaches a stack reads it: `--topology` / `-t`, `$POLAR_TOPOLOGY`,"
        " else `./topology.yaml`. `topology.example.yaml` shows every key with a comment.",
        "",
        *(section(t, PAGE) + "\n" for t in topo),
        "## Services",
        "",
        "What `polar up` can start (`infra/catalog.py`); `services.<name>` in the topology"
        " turns one off (`enabled: false`), moves its `port`, or sets its `config`: the keys"
        " of its settings below.",
        "",
        catalog_table(),
        "",
        "## Every service's settings",
        "",
        "`polar up` sets these from the topology (`nats_url`, `redis_url`, `nats_replicas`,"
        " `retention`, `host`, the port, the node); `polar serve NAME` takes them from"
        " `POLAR_CONFIG`, `POLAR_NATS_URL`, `POLAR_REDIS_URL` and `POLAR_NATS_REPLICAS`.",
        "",
        own_doc(ServiceSettings) or markdown(_settings_doc()),
        "",
        *(section(t, PAGE, level=3, fields=own_fields) + "\n" for t in shared),
        "## Each service's own settings",
        "",
        *(_service_section(t, users.get(t.cls, [])) + "\n" for t in services),
    ]
    return "\n".join(parts)


def _settings_doc() -> str:
    import services.common.settings as settings

    return settings.__doc__ or ""
