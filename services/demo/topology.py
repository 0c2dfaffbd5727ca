"""The learning demo's stack: every service on free ports, its own NATS and Valkey.

The model is the demo's own tiny byte-vocabulary model (``model_dir``), served by the
embedded engine with a batch wide enough for every question in flight at once; the
proxy templates with the same tokenizer (token mode).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from infra import localservers
from schemas.topology import NODE_DEFAULTS

SERVICES = ("model", "proxy", "scheduler", "pool", "executor", "builder", "evaluator", "dashboard")
MODEL_NAME = "polar-stars"


def stack_topology(
    state_dir: Path,
    model_dir: Path,
    *,
    max_run: int = 8,
    max_batch: int = 512,
    extra: dict[str, dict] | None = None,
    vllm_url: str | None = None,
) -> str:
    """The topology YAML. ``extra`` adds services (name -> topology entry); ``vllm_url``
    a vLLM (started by the caller) serves the model instead of the embedded engine."""
    names = (*(s for s in SERVICES if not (vllm_url and s == "model")), *(extra or {}))
    ports = {name: localservers.free_port() for name in ("nats", "redis", *names)}
    proxy_url = f"http://127.0.0.1:{ports['proxy']}"
    node_cfg = {"work_dir": str(state_dir / "work"), "proxy_url": proxy_url}
    services: dict[str, dict] = {
        "model": {
            "config": {
                "model_dir": str(model_dir),
                "served_model_name": MODEL_NAME,
                "default_max_tokens": 8,
                # prompts share only the template head: cache lookups cost more than they save
                "engine": {
                    "max_batch": max_batch,
                    "max_queue": 4 * max_batch,
                    "prefix_cache_tokens": 0,
                },
            }
        },
        "proxy": {"config": {"mode": "token", "model_dir": str(model_dir)}},
        "scheduler": {},
        # the engine's batch holds every call in flight: its queue is no signal to back off
        "pool": {"config": {**node_cfg, "backpressure_queue": 1e9, "backpressure_resume": 1e9}},
        "executor": {"config": node_cfg},
        "builder": {},
        "evaluator": {"config": node_cfg},
        "dashboard": {},
        **(extra or {}),
    }
    if vllm_url:
        del services["model"]
    for name, entry in services.items():
        entry["port"] = ports[name]
    topo = {
        "nats_url": f"nats://127.0.0.1:{ports['nats']}",
        "redis_url": f"redis://127.0.0.1:{ports['redis']}/0",
        "state_dir": str(state_dir),
        "startup_timeout_seconds": 180,
        "nodes": [
            {
                "name": "node0",
                "max_init": NODE_DEFAULTS.max_init,
                "ready_buffer": max_run,
                "max_run": max_run,
            }
        ],
        "backends": [
            {"name": "vllm", "kind": "vllm", "url": vllm_url, "model": MODEL_NAME}
            if vllm_url
            else {
                "name": "embedded",
                "kind": "embedded",
                "url": f"http://127.0.0.1:{ports['model']}",
                "model": MODEL_NAME,
            }
        ],
        "services": services,
    }
    return yaml.safe_dump(topo, sort_keys=False)
