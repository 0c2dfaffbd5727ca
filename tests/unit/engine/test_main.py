"""The embedded engine as the dev stack's `model` service: it starts (its routes and the
stack's ops routes do not clash), answers /healthz, and its /metrics carries both the
engine's SGLang-named queue gauges (the pool's backpressure reads them) and the
process's own registry, like every Polar service."""

from __future__ import annotations

import json

from litestar.testing import TestClient

from services.engine.main import create_app
from tests.unit.engine.tiny import tiny_model_dir


def test_the_model_service_starts_with_health_and_one_metrics_page(monkeypatch):
    monkeypatch.setenv("POLAR_CONFIG", json.dumps({"model_dir": str(tiny_model_dir())}))
    with TestClient(create_app()) as client:
        assert client.get("/healthz").json()["ok"] is True
        page = client.get("/metrics")
        assert page.status_code == 200
        lines = page.text.splitlines()
        assert any(line.startswith("sglang:num_queue_reqs{") for line in lines)
        assert any(line.startswith("sglang:num_running_reqs{") for line in lines)
        assert any(line.startswith("process_cpu_seconds_total") for line in lines)
