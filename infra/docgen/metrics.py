"""docs/reference/metrics.md: every Prometheus metric family Polar's processes register,
read from the registry itself after importing each module that defines one.

Those modules are found in the source (a ``Counter("polar_...`` and its kin), so a new
module with metrics is on the page without a list here to update; each family is listed
under the module that defines it, with its type, labels, buckets and help text.
"""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import REGISTRY

from infra.docgen.source import cell, markdown

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "proxy", "schemas", "evaluators", "infra")
_KINDS = "Counter|Gauge|Histogram|Summary|Info|Enum|CounterFamily|HistogramFamily"
SHARED = "services.common.metrics"  # every service's: listed first
DEFINITION = re.compile(rf"\b({_KINDS})\(\s*\"(polar_\w+)\"")


@dataclass(frozen=True)
class Family:
    name: str  # as scraped: a counter's with ``_total``
    kind: str
    labels: tuple[str, ...]
    help: str
    buckets: tuple[str, ...]
    module: str


def defined_in_source() -> dict[str, str]:
    """Each metric name a module constructs -> that module."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for _, name in DEFINITION.findall(path.read_text()):
                rel = path.relative_to(ROOT).with_suffix("")
                found[name] = ".".join(rel.parts)
    return found


def families() -> list[Family]:
    """The registry's families, each under the module whose global it is."""
    modules = sorted(set(defined_in_source().values()))
    for name in modules:
        importlib.import_module(name)
    registered = {id(c) for c in REGISTRY._collector_to_names}
    owners = {
        id(value): (value, name)
        for name in modules
        for value in vars(sys.modules[name]).values()
        if id(value) in registered
    }
    out = [_family(c, name) for c, name in owners.values()]
    shared_first = sorted(modules, key=lambda m: (m != SHARED, m))
    return sorted(out, key=lambda f: (shared_first.index(f.module), f.name))


def _family(collector, module: str) -> Family:
    (metric,) = collector.describe()
    kind = metric.type
    name = metric.name + ("_total" if kind == "counter" else "")
    labels = getattr(collector, "_labelnames", None) or getattr(collector, "labelnames", ())
    bounds = getattr(collector, "_upper_bounds", None) or getattr(collector, "le", None) or ()
    buckets = tuple(_bound(b) for b in bounds) if kind == "histogram" else ()
    return Family(name, kind, tuple(labels), metric.documentation, buckets, module)


def _bound(b: object) -> str:
    value = float(b)  # prometheus_client's floats, a tally's strings ("1.0", "+Inf")
    return "+Inf" if value == float("inf") else f"{value:g}"


def undocumented() -> list[str]:
    return [f.name for f in families() if not f.help.strip()]


def _module_title(name: str) -> str:
    doc = (sys.modules[name].__doc__ or "").strip().split("\n\n")[0]
    return markdown(" ".join(doc.split()))


def render() -> str:
    parts = [
        "# Prometheus metrics",
        "",
        "Every service serves its process's registry at `GET /metrics` (the proxy and the"
        " embedded engine too). A counter is scraped as `NAME_total`; a histogram as"
        " `NAME_bucket`, `NAME_sum` and `NAME_count`.",
        "",
    ]
    current = None
    for f in families():
        if f.module != current:
            current = f.module
            path = current.replace(".", "/") + ".py"
            parts += [
                "",
                f"## `{path}`",
                "",
                _module_title(current),
                "",
                "| metric | type | labels | what it counts |",
                "|---|---|---|---|",
            ]
        labels = ", ".join(f"`{x}`" for x in f.labels)
        text = f.help + (f" (buckets: {', '.join(f.buckets)})" if f.buckets else "")
        parts.append(f"| `{f.name}` | {f.kind} | {labels} | {cell(text)} |")
    return "\n".join(parts)
