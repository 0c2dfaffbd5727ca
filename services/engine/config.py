"""Configuration of the embedded model server (msgspec Structs; unknown keys are errors).

Kept free of torch so the command line can build and validate it cheaply.
"""

from __future__ import annotations

import os

import msgspec
from msgspec import Struct

from schemas.engine import DEFAULT_MODEL_DIR

CONFIG_ENV = "POLAR_EMBEDDED_CONFIG"


class EngineConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_batch: int = 32  # sequences generating together
    max_queue: int = 256  # requests waiting for a batch slot
    max_prefill_tokens: int = 4096  # prompt tokens computed per step (chunked prefill)
    prefix_cache_tokens: int = 65536  # 0 disables reuse of finished sequences' caches
    context_limit: int = 0  # 0: the model's max_position_embeddings


class ServeConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # the model to serve (`polar model init DIR` writes one)
    model_dir: str = str(DEFAULT_MODEL_DIR)
    host: str = "127.0.0.1"  # where it listens
    port: int = 30000  # its port
    policy: str | None = None  # scripted policy YAML
    served_model_name: str = ""  # default: the directory name
    weight_version: str = "1"  # the version its first weights report
    threads: int = 1  # torch intra-op threads for the engine
    default_max_tokens: int = 256  # tokens generated when a request sets no limit
    engine: EngineConfig = EngineConfig()  # the batching engine's bounds
    # Every route but /healthz and /metrics needs `Authorization: Bearer <api_key>`
    # (SGLang's and vLLM's --api-key); None: open, for a server only its user reaches.
    # `polar up` always sets one: a harness on the node's network must not pause the
    # engine, swap its weights or sample from it uncaptured.
    api_key: str | None = None


def config_from_env() -> ServeConfig:
    return msgspec.json.decode(os.environ.get(CONFIG_ENV, "{}").encode(), type=ServeConfig)


def config_to_env(config: ServeConfig) -> str:
    return msgspec.json.encode(config).decode()
