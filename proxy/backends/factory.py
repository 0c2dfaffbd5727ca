"""Build the backend a topology names: engine kind + worker URLs -> one ``BackendPool``.

A topology backend's ``settings`` (topology.yaml ``backends[].settings``) are checked here
against the kind's own settings struct, so a misspelt or unknown name refuses the proxy's
start instead of being silently dropped::

    settings (every kind):  health_interval_s, failure_threshold, http: {timeout_s, ...}
      sglang | embedded:    pause_mode (abort | retract | in_place; unset: the server's)
      vllm:                 pause_mode (abort | wait | keep), reload_path (a deployment's
                            own reload endpoint; unset: stock vLLM's /collective_rpc
                            reload_weights)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from proxy.backends.http import HttpSettings
from proxy.backends.pool import BackendPool
from proxy.backends.sglang import ALL_MODES, SGLangBackend
from proxy.backends.vllm import VLLMBackend
from schemas.completion import UpstreamMode


class PoolSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings every kind takes: the worker pool's and the HTTP client's."""

    health_interval_s: float = 2.0
    failure_threshold: int = 2
    http: HttpSettings = HttpSettings()

    def engine_options(self) -> dict[str, Any]:
        """The kind's own settings, as its client's keyword arguments."""
        common = set(PoolSettings.__struct_fields__)
        return {f: getattr(self, f) for f in self.__struct_fields__ if f not in common}


class SGLangSettings(PoolSettings, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pause_mode: Literal["abort", "retract", "in_place"] | None = None


class VLLMSettings(PoolSettings, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pause_mode: Literal["abort", "wait", "keep"] = "abort"
    reload_path: str | None = None


# The embedded CPU model server speaks SGLang's surface.
ENGINES: dict[str, tuple[type, type[PoolSettings]]] = {
    "sglang": (SGLangBackend, SGLangSettings),
    "vllm": (VLLMBackend, VLLMSettings),
    "embedded": (SGLangBackend, SGLangSettings),
}


class BackendSettingsError(ValueError):
    pass


def engine_settings(kind: str, settings: Mapping[str, Any] | None = None) -> PoolSettings:
    """``settings`` checked against ``kind``'s: an unknown name or a bad value is an error
    that names it and lists what the kind takes."""
    if kind not in ENGINES:
        raise BackendSettingsError(f"unknown backend kind {kind!r}; one of {sorted(ENGINES)}")
    struct = ENGINES[kind][1]
    try:
        return msgspec.convert(dict(settings or {}), struct)
    except msgspec.ValidationError as exc:
        known = sorted(struct.__struct_fields__)
        raise BackendSettingsError(
            f"{kind} backend settings: {exc}; {kind} backends take {known}"
        ) from None


def make_pool(
    kind: str,
    urls: list[str],
    *,
    model: str = "default",
    modes: tuple[UpstreamMode, ...] = ALL_MODES,
    settings: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> BackendPool:
    """A pool of ``kind`` clients at ``urls``; ``settings`` (a topology backend's), with
    ``overrides`` on top, are checked as ``engine_settings`` checks them."""
    checked = engine_settings(kind, {**(settings or {}), **overrides})
    engine = ENGINES[kind][0]
    backends = [
        engine(url, model=model, modes=modes, http=checked.http, **checked.engine_options())
        for url in urls
    ]
    return BackendPool(
        backends,
        health_interval_s=checked.health_interval_s,
        failure_threshold=checked.failure_threshold,
    )
