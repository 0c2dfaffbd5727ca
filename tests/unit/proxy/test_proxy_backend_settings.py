"""topology.yaml ``backends[].settings`` -> the proxy's config -> the pool's clients: what
each kind takes reaches its client, and an unknown or bad name refuses the start."""

from __future__ import annotations

import json

import pytest

from infra.catalog import SERVICES
from infra.topology import Node, ServiceEntry, parse_topology, service_config
from proxy.backends.factory import BackendSettingsError, engine_settings, make_pool
from proxy.backends.sglang import SGLangBackend
from proxy.backends.vllm import VLLMBackend
from proxy.config import ProxyConfig
from proxy.main import create_app
from services.common.settings import load

VLLM_TOPOLOGY = """
backends:
  - name: gpu0
    kind: vllm
    url: http://10.0.0.1:8000
    model: Qwen/Qwen3-0.6B
    settings:
      reload_path: /reload_weights
      pause_mode: keep
      health_interval_s: 0.5
      http: {timeout_s: 60, api_key: sk-test}
  - name: gpu1
    kind: vllm
    url: http://10.0.0.2:8000
    settings: {reload_path: /reload_weights}
"""


def proxy_config(topology: str) -> ProxyConfig:
    """The proxy's config as ``polar up`` hands it over: topology -> POLAR_CONFIG -> load."""
    topo = parse_topology(topology)
    cfg = service_config(SERVICES["proxy"], ServiceEntry(), topo, Node(name="node0"), 8200)
    return load(ProxyConfig, {"POLAR_CONFIG": json.dumps(cfg)})


def test_topology_settings_reach_every_vllm_client_and_the_pool():
    engine = proxy_config(VLLM_TOPOLOGY).engine()
    assert engine.settings == {
        "reload_path": "/reload_weights",
        "pause_mode": "keep",
        "health_interval_s": 0.5,
        "http": {"timeout_s": 60, "api_key": "sk-test"},
    }
    pool = make_pool(engine.kind, engine.urls, model=engine.model, settings=engine.settings)
    clients = [w.backend for w in pool.workers.values()]
    assert [c.base_url for c in clients] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    for c in clients:
        assert isinstance(c, VLLMBackend)
        assert (c.reload_path, c.pause_mode, c.model) == ("/reload_weights", "keep", engine.model)
        assert (c.http.settings.timeout_s, c.http.settings.api_key) == (60, "sk-test")
    assert (pool.health_interval_s, pool.failure_threshold) == (0.5, 2)


def test_sglang_and_embedded_take_a_pause_mode():
    for kind in ("sglang", "embedded"):
        pool = make_pool(kind, ["http://h:1"], settings={"pause_mode": "in_place"})
        (client,) = [w.backend for w in pool.workers.values()]
        assert isinstance(client, SGLangBackend) and client.pause_mode == "in_place"
    (client,) = [w.backend for w in make_pool("sglang", ["http://h:1"]).workers.values()]
    assert client.pause_mode is None  # unset: the server's own default


def test_no_settings_keep_the_defaults():
    engine = proxy_config("backends: [{kind: vllm, url: 'http://h:1'}]").engine()
    (client,) = [w.backend for w in make_pool(engine.kind, engine.urls).workers.values()]
    assert (client.reload_path, client.pause_mode) == (None, "abort")


@pytest.mark.parametrize(
    ("kind", "settings", "named"),
    [
        ("vllm", {"relaod_path": "/r"}, "unknown field `relaod_path`"),
        ("sglang", {"reload_path": "/r"}, "unknown field `reload_path`"),  # vLLM's, not SGLang's
        ("embedded", {"pause_mode": "keep"}, "Invalid enum value 'keep' - at `$.pause_mode`"),
        ("vllm", {"http": {"timeot_s": 1}}, "unknown field `timeot_s` - at `$.http`"),
        ("vllm", {"failure_threshold": "two"}, "Expected `int`, got `str`"),
    ],
)
def test_an_unknown_or_bad_setting_is_an_error_naming_it(kind, settings, named):
    with pytest.raises(BackendSettingsError) as err:
        engine_settings(kind, settings)
    assert named in str(err.value) and f"{kind} backends take [" in str(err.value)


def test_the_proxy_refuses_to_start_with_an_unknown_setting():
    topology = "backends: [{kind: vllm, url: 'http://h:1', settings: {reload: /r}}]"
    with pytest.raises(BackendSettingsError, match="unknown field `reload`.*'reload_path'"):
        create_app(proxy_config(topology))  # at construction, before anything connects


def test_entries_of_one_pool_cannot_disagree_on_a_setting():
    topology = """
backends:
  - {name: a, kind: vllm, url: 'http://h:1', settings: {reload_path: /a}}
  - {name: b, kind: vllm, url: 'http://h:2', settings: {reload_path: /b}}
"""
    with pytest.raises(ValueError, match="'a' and 'b' set `reload_path` differently"):
        proxy_config(topology).engine()


def test_the_single_backend_config_takes_settings_too():
    cfg = load(
        ProxyConfig,
        {
            "POLAR_CONFIG": json.dumps(
                {"backend": {"kind": "vllm", "settings": {"reload_path": "/r"}}}
            )
        },
    )
    (client,) = [
        w.backend
        for w in make_pool(
            cfg.engine().kind, ["http://h:1"], settings=cfg.engine().settings
        ).workers.values()
    ]
    assert client.reload_path == "/r"
