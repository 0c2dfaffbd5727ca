"""The embedded engine and the proxy are two services: neither imports the other.

The proxy reaches the engine over HTTP (its SGLang client); the facts both need live in
shared packages (``schemas/engine.py``, ``services/common/tokenization``)."""

from __future__ import annotations

import ast
from pathlib import Path

from proxy.config import BackendConfig, ProxyConfig
from services.engine.config import ServeConfig

ROOT = Path(__file__).resolve().parents[3]


def imported_modules(package: str) -> dict[str, set[str]]:
    """Every absolute import in a package's modules (function-level ones included)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def imports_of(package: str, forbidden: str) -> list[str]:
    return [
        f"{path} imports {name}"
        for path, names in imported_modules(package).items()
        for name in sorted(names)
        if name == forbidden or name.startswith(forbidden + ".")
    ]


def test_the_proxy_imports_nothing_from_the_engine():
    assert imports_of("proxy", "services.engine") == []


def test_the_engine_imports_nothing_from_the_proxy():
    assert imports_of("services.engine", "proxy") == []


def test_the_proxy_loads_the_tokenizer_of_the_model_the_engine_serves_by_default():
    proxy = ProxyConfig(backend=BackendConfig(kind="embedded"))
    assert proxy.tokenizer_dir() == ServeConfig().model_dir
