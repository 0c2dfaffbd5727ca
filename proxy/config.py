from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from proxy.io.limits import HttpLimits
from schemas.engine import DEFAULT_MODEL_DIR
from schemas.topology import EMBEDDED_URL, Backend
from services.common.settings import ENGINE_KEY_ENV, ServiceSettings, unset

EMBEDDED = "embedded"


class BackendConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kind: str = "embedded"  # sglang | vllm | embedded (SGLang surface)
    # the engines' base URLs: one pool
    urls: list[str] = msgspec.field(default_factory=lambda: [EMBEDDED_URL])
    model: str = "default"  # the model name the engines are asked for
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
    backend: BackendConfig = BackendConfig()  # the engines when `backends` is empty
    backends: list[Backend] = []  # from topology.yaml; overrides `backend` when set
    mode: str = "token"  # token (TITO: proxy templates, sends ids) | chat (engine templates)
    model_dir: str | None = None  # tokenizer + chat template for token mode
    # the HTTP server's bounds: head/body/idle timeouts, connection caps (proxy/io/limits.py)
    http_server: HttpLimits = HttpLimits()
    # the model family (docs/models.md: qwen3, qwen3_5, llama3, gpt_oss, deepseek_v3,
    # mistral, ...); None: detected from model_dir's config.json and chat template
    model_family: str | None = None
    # token mode, a template that renders earlier turns otherwise once more follows
    # (reasoning dropped before the last user turn): keep_sampled continues the chain with
    # the history as the model sampled it; rerender renders it as the template does, and
    # the call starts a new chain named by the cause (proxy/tito.py)
    history: str = "keep_sampled"
    # MoE models, token mode: ask the engine for the experts it routed every token to and
    # record them (R3, docs/training.md); the engine must be started with
    # --enable-return-routed-experts (vLLM >= 0.32, SGLang; the embedded engine always can)
    routed_experts: bool = False
    default_max_tokens: int = 1024  # a call's token limit when its request sets none
    # A body over this is refused (413) before it is read.
    max_body_bytes: int = 16 * 1024 * 1024
    # The model's context in tokens: a prompt whose text alone cannot fit it is refused
    # (400, context_length) before it is templated or tokenized (proxy/promptbound.py). None:
    # the engine's, as its probe reports it, else model_dir's config.json; 0: no such check.
    context_tokens: int | None = None
    # a streamed call still running after this gets keep-alives until its answer
    keepalive_seconds: float = 10.0
    # Poll instead of sleeping for up to this long while a Redis or JetStream reply is
    # due (never the engine's: proxy/io/spin.py); 0: off.
    busy_poll_microseconds: int = 250
    probe_backend: bool = True  # refuse to start when the engine cannot return token ids
    probe_timeout_seconds: float = 120.0  # the engine may still be starting
    # /admin/* (pause, weights) needs `Authorization: Bearer <admin_token>`; without one
    # it is closed: a harness can reach this port, and must not pause it or swap weights.
    admin_token: str | None = None

    def with_env_secrets(self, env: Mapping[str, str]) -> ProxyConfig:
        """``POLAR_ENGINE_API_KEY``, when set, is presented to the backends of kind
        ``embedded`` (Polar's own engine, which reads that same variable) that name no
        ``settings.http.api_key``. An SGLang or vLLM backend never gets it: a key meant
        for one engine must not be sent to another's server; give theirs in the config."""
        key = env.get(ENGINE_KEY_ENV)
        return self.with_engine_key(key) if key else self

    def with_engine_key(self, key: str) -> ProxyConfig:
        backend = self.backend
        if backend.kind == EMBEDDED and not _has_key(backend.settings):
            backend = msgspec.structs.replace(backend, settings=_keyed(backend.settings, key))
        embedded = [b for b in self.backends if b.kind == EMBEDDED]
        # one pool serves a kind's entries with their settings merged (merged_settings):
        # a key any of them names is the group's, so none is added beside it
        if embedded and not any(_has_key(b.settings) for b in embedded):
            backends = [
                msgspec.structs.replace(b, settings=_keyed(b.settings, key))
                if b.kind == EMBEDDED
                else b
                for b in self.backends
            ]
        else:
            backends = self.backends
        return msgspec.structs.replace(self, backend=backend, backends=backends)

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


def _has_key(settings: dict[str, Any]) -> bool:
    http = settings.get("http") or {}
    # a malformed `http` is left as it is, for the backend factory to refuse by name
    return not isinstance(http, dict) or not unset(http.get("api_key"))


def _keyed(settings: dict[str, Any], key: str) -> dict[str, Any]:
    return {**settings, "http": {**(settings.get("http") or {}), "api_key": key}}
