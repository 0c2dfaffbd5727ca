from __future__ import annotations

from typing import Any

import msgspec

from schemas.engine import DEFAULT_MODEL_DIR
from schemas.topology import EMBEDDED_URL, Backend
from services.common.settings import ServiceSettings


class BackendConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kind: str = "embedded"  # sglang | vllm | embedded (SGLang surface)
    urls: list[str] = msgspec.field(default_factory=lambda: [EMBEDDED_URL])
    model: str = "default"
    # the kind's client and pool settings (proxy/backends/factory.py), e.g. a vLLM
    # deployment's reload_path or SGLang's pause_mode; an unknown name refuses the start
    settings: dict[str, Any] = {}


def merged_settings(group: list[Backend]) -> dict[str, Any]:
    """One pool serves the group, so its entries' settings are one set: a name may be
    given on any entry, but two entries giving it different values is an error."""
    merged: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for b in group:
        for key, value in b.settings.items():
            if key in merged and merged[key] != value:
                raise ValueError(
                    f"backends {owner[key]!r} and {b.name!r} set `{key}` differently "
                    f"({merged[key]!r} vs {value!r}); one pool serves them both"
                )
            merged[key], owner[key] = value, b.name
    return merged


class ProxyConfig(ServiceSettings, frozen=True, kw_only=True):
    port: int = 8200
    backend: BackendConfig = BackendConfig()
    backends: list[Backend] = []  # from topology.yaml; overrides `backend` when set
    mode: str = "token"  # token (TITO: proxy templates, sends ids) | chat (engine templates)
    model_dir: str | None = None  # tokenizer + chat template for token mode
    default_max_tokens: int = 1024
    max_body_bytes: int = 16 * 1024 * 1024
    keepalive_seconds: float = 10.0
    # Poll instead of sleeping for up to this long while a Redis, JetStream or engine
    # reply is due (proxy/io/spin.py); 0: off.
    busy_poll_microseconds: int = 250
    probe_backend: bool = True  # refuse to start when the engine cannot return token ids
    probe_timeout_seconds: float = 120.0  # the engine may still be starting
    # /admin/* (pause, weights) needs `Authorization: Bearer <admin_token>`; without one
    # it is closed: a harness can reach this port, and must not pause it or swap weights.
    admin_token: str | None = None

    def engine(self) -> BackendConfig:
        """The backend to use: the topology's first kind (all its URLs, their settings
        merged), else ``backend``."""
        if not self.backends:
            return self.backend
        kind = self.backends[0].kind
        group = [b for b in self.backends if b.kind == kind]
        return BackendConfig(
            kind=kind,
            urls=[b.base_url for b in group],
            model=group[0].model or "default",
            settings=merged_settings(group),
        )

    def tokenizer_dir(self) -> str | None:
        """Token mode needs the served model's tokenizer; the embedded one is known."""
        if self.model_dir:
            return self.model_dir
        if self.engine().kind == "embedded":
            return str(DEFAULT_MODEL_DIR)
        return None
