"""The reference pages written from the code: ``python -m infra.docgen`` (``just
docs-reference``) writes them, ``--check`` says which are out of date (a test runs it).

- docs/reference/task.md: every field of a task (``schemas/task.py``), the built-in
  evaluators and builders;
- docs/reference/harnesses.md: a harness's environment (``SESSION_ENV``), the CLI
  presets' settings, files, variables and command lines.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from infra.docgen import harnesses, task

ROOT = Path(__file__).resolve().parents[2]
HEADER = (
    "<!-- Written by `python -m infra.docgen` (`just docs-reference`) from the code it "
    "describes: edit the code, then run it. -->\n\n"
)
PAGES: dict[str, Callable[[], str]] = {
    "docs/reference/task.md": task.render,
    "docs/reference/harnesses.md": harnesses.render,
}


def pages() -> dict[str, str]:
    """Each page's path (relative to the repository) -> its text, as the code says now."""
    return {path: HEADER + render().rstrip() + "\n" for path, render in PAGES.items()}


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
