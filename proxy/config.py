from __future__ import annotations

import msgspec

from services.common.settings import ServiceSettings


class BackendConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kind: str = "embedded"  # sglang | vllm | embedded (SGLang surface)
    urls: list[str] = msgspec.field(default_factory=lambda: ["http://127.0.0.1:30000"])
    model: str = "default"


class ProxyConfig(ServiceSettings, frozen=True, kw_only=True):
    port: int = 8200
    backend: BackendConfig = BackendConfig()
    mode: str = "token"  # token (TITO: proxy templates, sends ids) | chat (engine templates)
    model_dir: str | None = None  # tokenizer + chat template for token mode
    grace_seconds: float = 30.0  # a token stays valid this long after RUNNING ends
    default_max_tokens: int = 1024
    max_body_bytes: int = 64 * 1024 * 1024
    keepalive_seconds: float = 10.0
    probe_backend: bool = True  # refuse to start when the engine cannot return token ids
