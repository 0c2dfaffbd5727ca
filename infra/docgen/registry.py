"""The reference pages and what writes each (``infra/docgen/__init__.py`` says which)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from infra.docgen import cli, harnesses, httpapi, metrics, subjects, task, topology, trajectory

ROOT = Path(__file__).resolve().parents[2]
HEADER = (
    "<!-- Written by `python -m infra.docgen` (`just docs-reference`) from the code it "
    "describes: edit the code, then run it. -->\n\n"
)
PAGES: dict[str, Callable[[], str]] = {
    "docs/reference/cli.md": cli.render,
    "docs/reference/task.md": task.render,
    "docs/reference/topology.md": topology.render,
    "docs/reference/http-api.md": httpapi.render,
    "docs/reference/openapi.json": httpapi.json_text,
    "docs/reference/subjects.md": subjects.render,
    "docs/reference/metrics.md": metrics.render,
    "docs/reference/trajectory.md": trajectory.render,
    "docs/reference/harnesses.md": harnesses.render,
}
# Each page's parts that have no description: "Class.field", a command, a metric.
UNDOCUMENTED: dict[str, Callable[[], list[str]]] = {
    "docs/reference/cli.md": cli.undocumented,
    "docs/reference/topology.md": topology.undocumented_fields,
    "docs/reference/http-api.md": httpapi.undocumented_parts,
    "docs/reference/subjects.md": lambda: (
        subjects.undocumented_names() + subjects.undocumented_fields()
    ),
    "docs/reference/metrics.md": metrics.undocumented,
    "docs/reference/trajectory.md": trajectory.undocumented_fields,
}


def pages() -> dict[str, str]:
    """Each page's path (relative to the repository) -> its text, as the code says now."""
    return {path: _page(path, render()) for path, render in PAGES.items()}


def _page(path: str, text: str) -> str:
    if path.endswith(".md"):
        return HEADER + portable(text).rstrip() + "\n"
    return portable(text).rstrip() + "\n"


def portable(text: str) -> str:
    """This machine's home directory as ``~`` (a default under it is the same on any)."""
    return re.sub(re.escape(str(Path.home())) + r"(?=/|\b)", "~", text)


def stale(root: Path = ROOT) -> list[str]:
    """The pages whose committed text differs from what the code says now."""
    return [p for p, text in pages().items() if _read(root / p) != text]


def write(root: Path = ROOT) -> list[str]:
    """Write every page that changed; returns their paths."""
    changed = stale(root)
    for path, text in pages().items():
        if path in changed:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
    return changed


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
