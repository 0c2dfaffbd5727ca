"""The topology's shared shapes, declared once: a node's bounds and an inference backend.

``infra/topology.py`` reads them from ``topology.yaml``; the proxy and the pool take them
in their configs.
"""

from __future__ import annotations

from typing import Any

import msgspec

EMBEDDED_URL = "http://127.0.0.1:30000"  # the stack's own model server (`model` service)


class NodeBounds(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How many sessions one node holds in each stage (services/pool/logic.py enforces)."""

    max_init: int = 4  # sandboxes being prepared at once
    ready_buffer: int = 4  # prepared sandboxes waiting for a RUNNING slot
    max_run: int = 8  # harnesses running at once


class Backend(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A ``backends:`` entry: an inference server URL, or the embedded CPU model."""

    name: str = "default"  # names the entry in errors and on the dashboard
    kind: str = "sglang"  # sglang | vllm | embedded
    url: str | None = None  # base URL; None: the embedded model server the stack runs
    model: str | None = None  # the model name the engine is asked for; None: "default"
    # the kind's client and pool settings (entries of one kind must agree)
    settings: dict[str, Any] = {}

    @property
    def base_url(self) -> str:
        return self.url or EMBEDDED_URL


NODE_DEFAULTS = NodeBounds()
