"""Build the backend a topology names: engine kind + worker URLs -> one ``BackendPool``."""

from __future__ import annotations

from typing import Any

from proxy.backends.http import HttpSettings
from proxy.backends.pool import BackendPool
from proxy.backends.sglang import ALL_MODES, SGLangBackend
from proxy.backends.vllm import VLLMBackend
from schemas.completion import UpstreamMode

# The embedded CPU model server speaks SGLang's surface.
ENGINES: dict[str, type] = {"sglang": SGLangBackend, "vllm": VLLMBackend, "embedded": SGLangBackend}


def make_pool(
    kind: str,
    urls: list[str],
    *,
    model: str = "default",
    modes: tuple[UpstreamMode, ...] = ALL_MODES,
    http: HttpSettings | None = None,
    health_interval_s: float = 2.0,
    failure_threshold: int = 2,
    **engine_options: Any,
) -> BackendPool:
    engine = ENGINES.get(kind)
    if engine is None:
        raise ValueError(f"unknown backend kind {kind!r}; one of {sorted(ENGINES)}")
    backends = [engine(url, model=model, modes=modes, http=http, **engine_options) for url in urls]
    return BackendPool(
        backends, health_interval_s=health_interval_s, failure_threshold=failure_threshold
    )
