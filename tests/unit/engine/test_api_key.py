"""The engine's api key (issue 17): with one, every route that generates, reads the
model or changes state is a 401 in the engine's error shape without the right bearer
token; liveness and metrics stay open; the key is never served back. Without one (a
standalone `polar model serve`), the engine answers as SGLang does without --api-key."""

from __future__ import annotations

import json

import pytest
from litestar.testing import TestClient

from services.engine.main import create_app
from tests.unit.engine.tiny import tiny_model_dir

KEY = "pe_test-key"
GUARDED = [
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/flush_cache", None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
    ("GET", "/health_generate", None),
    ("GET", "/v1/models", None),
    ("GET", "/get_model_info", None),
    ("GET", "/get_server_info", None),
    ("GET", "/get_weight_version", None),
]


@pytest.fixture(scope="module")
def client():
    config = {"model_dir": str(tiny_model_dir()), "api_key": KEY}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POLAR_CONFIG", json.dumps(config))
        with TestClient(create_app()) as c:
            yield c


@pytest.mark.parametrize(("method", "path", "body"), GUARDED)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}", "Bearer "])
def test_without_the_key_every_engine_route_is_a_401(client, method, path, body, auth):
    headers = {"authorization": auth} if auth else {}
    r = client.request(method, path, json=body, headers=headers)
    assert r.status_code == 401, (path, r.text)
    error = r.json()
    assert error["object"] == "error" and error["code"] == 401 and error["type"] == "Unauthorized"
    assert r.headers["www-authenticate"] == "Bearer"
    assert KEY not in r.text


def test_the_refusal_changes_nothing(client):
    """A refused pause did not pause: a keyed generation still completes."""
    assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 401
    keyed = {"authorization": f"Bearer {KEY}"}
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    r = client.post("/generate", json=body, headers=keyed)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 2


def test_with_the_key_the_routes_answer_and_the_key_is_not_served(client):
    keyed = {"authorization": f"Bearer {KEY}"}
    assert client.get("/get_weight_version", headers=keyed).json() == {"weight_version": "1"}
    info = client.get("/get_server_info", headers=keyed)
    assert info.status_code == 200 and KEY not in info.text and "api_key" not in info.json()
    assert client.post("/pause_generation", json={}, headers=keyed).status_code == 200
    assert client.post("/continue_generation", headers=keyed).status_code == 200


@pytest.mark.parametrize("path", ["/healthz", "/health", "/metrics"])
def test_liveness_and_metrics_stay_open(client, path):
    assert client.get(path).status_code == 200


def test_without_a_key_configured_the_engine_is_open(monkeypatch):
    monkeypatch.setenv("POLAR_CONFIG", json.dumps({"model_dir": str(tiny_model_dir())}))
    with TestClient(create_app()) as c:
        assert c.get("/get_weight_version").status_code == 200
        assert c.post("/continue_generation").status_code == 200
