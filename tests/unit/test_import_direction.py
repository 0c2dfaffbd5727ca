"""Packages import in one direction: the layers of docs/explanation/architecture.md, lowest first.

A package may import only packages of lower layers (never one of its own layer, never a
higher one), so there are no cycles. Imports inside functions count too: a lazy import
is still a dependency. A new package must be placed in a layer here (and in the doc).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("schemas", "services", "proxy", "evaluators", "infra")

LAYERS: list[set[str]] = [
    {"schemas"},  # the contract: imports nothing of Polar
    {"services.common"},  # bus, registry, consumer, settings, tokenization, HTTP host
    {"services.runtimes", "services.engine", "services.client", "evaluators"},
    {"proxy", "services.node", "services.export"},
    {
        "services.builder",  # waits for every call the proxy numbered (proxy.callcount)
        "services.pool",
        "services.executor",
        "services.evaluator",
        "services.scheduler",
        "services.trainer",
    },
    {"services.regrade", "services.bundle"},  # polar regrade / bundle: evaluators, records
    {"infra"},  # topology, wiring, local servers, set-up: starts the services above
    {"services.demo"},
    {"services.cli"},  # the `polar` command
    {"services.dashboard"},  # reads what `polar status` reads, acts through the CLI's commands
    {"infra.docgen"},  # the reference pages: read every package above (docs, not runtime)
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def package_of(module: str) -> str:
    parts = module.split(".")
    if parts[:2] == ["infra", "docgen"]:
        return "infra.docgen"
    return ".".join(parts[:2]) if parts[0] == "services" and len(parts) > 1 else parts[0]


def imported_modules(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The modules an import statement in ``module`` names, absolute: a relative import
    is resolved against the file's package, and ``from services import pool`` names
    ``services.pool`` (the package it imports), not the namespace ``services``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        up = package[: len(package) - (node.level - 1)]
        base = ".".join([*up, base] if base else up)
    if base in TOP:  # from services import pool: each name may be a package of its own
        return [f"{base}.{a.name}" for a in node.names]
    return [base]


def imports_between_packages(root: Path = ROOT) -> set[tuple[str, str, str]]:
    """(importing package, imported package, file) for every import across packages."""
    found = set()
    for top in TOP:
        for path in (root / top).rglob("*.py"):
            rel = path.relative_to(root)
            is_package = path.name == "__init__.py"
            module = ".".join(rel.parent.parts if is_package else rel.with_suffix("").parts)
            src = package_of(module)
            for node in ast.walk(ast.parse(path.read_text(), str(rel))):
                for name in imported_modules(node, module, is_package):
                    if name.split(".")[0] in TOP and name != "services":
                        dst = package_of(name)
                        if dst != src:
                            found.add((src, dst, str(rel)))
    return found


def test_every_package_has_a_layer():
    packages = {p for edge in imports_between_packages() for p in edge[:2]}
    packages |= {
        f"services.{d.name}" for d in (ROOT / "services").iterdir() if (d / "__init__.py").exists()
    }
    assert sorted(packages - LAYER_OF.keys()) == [], "place new packages in LAYERS"


def wrong_way(edges: set[tuple[str, str, str]]) -> list[str]:
    return sorted(
        f"{file}: {src} (layer {LAYER_OF.get(src)}) imports {dst} (layer {LAYER_OF.get(dst)})"
        for src, dst, file in edges
        if LAYER_OF.get(src, -1) <= LAYER_OF.get(dst, 99)
    )


def test_imports_go_down_the_layers_only():
    assert wrong_way(imports_between_packages()) == []


def test_the_checker_reports_upward_and_same_layer_imports(tmp_path):
    files = {
        "schemas/a.py": "from services.pool import config\n",  # upward
        "services/pool/b.py": "def f():\n    import services.executor.handlers\n",  # same layer
        "services/node/c.py": "from schemas import Session\n",  # fine
        "services/node/d.py": "from services import executor\n",  # upward, via the namespace
        "services/builder/e.py": "from ..scheduler import logic\n",  # same layer, relative
        "services/builder/f.py": "from . import logic\nfrom .logic import g\n",  # own package
        "proxy/io/__init__.py": "from ...services import cli\n",  # relative from a package
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert wrong_way(imports_between_packages(tmp_path)) == [
        "proxy/io/__init__.py: proxy (layer 3) imports services.cli (layer 8)",
        "schemas/a.py: schemas (layer 0) imports services.pool (layer 4)",
        "services/builder/e.py: services.builder (layer 4) imports services.scheduler (layer 4)",
        "services/node/d.py: services.node (layer 3) imports services.executor (layer 4)",
        "services/pool/b.py: services.pool (layer 4) imports services.executor (layer 4)",
    ]
