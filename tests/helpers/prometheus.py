"""Reading a Prometheus text exposition (a service's or an engine's ``/metrics``), for tests."""

from __future__ import annotations


def metric(text: str, name: str, **labels: str) -> float:
    """The first sample of ``name`` whose labels include ``labels`` (0 when none: a
    counter not yet incremented is often absent)."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, value = line.rsplit(" ", 1)
        found, _, rest = head.partition("{")
        pairs = dict(p.split("=", 1) for p in rest.rstrip("}").split(",")) if rest else {}
        if found == name and labels.items() <= {k: v.strip('"') for k, v in pairs.items()}.items():
            return float(value)
    return 0.0
