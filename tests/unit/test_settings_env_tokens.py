"""Credentials from the environment (services/common/settings.py ``load``): a deployment
(compose, Kubernetes Secret, Slurm) hands the tokens as POLAR_ADMIN_TOKEN,
POLAR_READ_TOKEN and POLAR_ENGINE_API_KEY; a token in the service's config wins, and the
engine key goes only to backends of Polar's own engine."""

from __future__ import annotations

import json

import pytest
from litestar.testing import TestClient

from proxy.config import ProxyConfig
from services.builder.config import BuilderConfig
from services.common.settings import ConfigError, load
from services.dashboard.config import DashboardConfig
from services.scheduler.config import SchedulerConfig
from services.trainer.config import TrainerConfig

ENV = {"POLAR_ADMIN_TOKEN": "pa_env", "POLAR_READ_TOKEN": "pr_env"}


def env(config: dict | None = None, **extra: str) -> dict[str, str]:
    return {"POLAR_CONFIG": json.dumps(config or {}), **ENV, **extra}


def test_tokens_come_from_the_environment_when_the_config_has_none():
    cfg = load(SchedulerConfig, env())
    assert (cfg.admin_token, cfg.read_token) == ("pa_env", "pr_env")
    dash = load(DashboardConfig, env())
    assert (dash.admin_token, dash.read_token) == ("pa_env", "pr_env")


def test_the_config_wins_over_the_environment():
    cfg = load(SchedulerConfig, env({"admin_token": "pa_cfg", "read_token": "pr_cfg"}))
    assert (cfg.admin_token, cfg.read_token) == ("pa_cfg", "pr_cfg")
    # one set, the other from the environment
    cfg = load(SchedulerConfig, env({"admin_token": "pa_cfg"}))
    assert (cfg.admin_token, cfg.read_token) == ("pa_cfg", "pr_env")


@pytest.mark.parametrize("given", [None, ""])
def test_a_null_or_empty_config_token_is_unset(given):
    cfg = load(SchedulerConfig, env({"admin_token": given}))
    assert cfg.admin_token == "pa_env"


def test_an_empty_variable_gives_nothing():
    # compose's `${POLAR_READ_TOKEN:-}` passes an empty string: the route stays closed
    cfg = load(SchedulerConfig, env(POLAR_ADMIN_TOKEN="", POLAR_READ_TOKEN=""))
    assert (cfg.admin_token, cfg.read_token) == (None, None)


def test_a_service_without_token_fields_ignores_them():
    # BuilderConfig forbids unknown keys: the variables must not become config keys
    assert load(BuilderConfig, env()).nats_url.startswith("nats://")


def test_the_trainer_takes_the_admin_token_it_pushes_weights_with():
    config = {"tasks": {"path": "tasks.jsonl"}, "model_dir": "m", "checkpoint_dir": "c"}
    assert load(TrainerConfig, env(config)).admin_token == "pa_env"


def test_a_config_that_is_not_an_object_is_refused():
    with pytest.raises(ConfigError, match="not a JSON object"):
        load(SchedulerConfig, {"POLAR_CONFIG": "[1]"})


# -- the engine key: the proxy's backends and the model service -------------------------


def http_key(settings: dict) -> str | None:
    return (settings.get("http") or {}).get("api_key")


def test_the_default_embedded_backend_presents_the_engine_key():
    cfg = load(ProxyConfig, env(POLAR_ENGINE_API_KEY="pe_env"))
    assert cfg.backend.kind == "embedded"
    assert http_key(cfg.engine().settings) == "pe_env"
    assert cfg.admin_token == "pa_env"


def test_an_sglang_or_vllm_backend_never_gets_the_engine_key():
    for kind in ("sglang", "vllm"):
        backend = {"kind": kind, "urls": ["http://gpu-0:30000"]}
        cfg = load(ProxyConfig, env({"backend": backend}, POLAR_ENGINE_API_KEY="pe_env"))
        assert http_key(cfg.engine().settings) is None
    backends = [
        {"name": "gpu", "kind": "sglang", "url": "http://gpu-0:30000"},
        {"name": "cpu", "kind": "embedded", "url": "http://model:30000"},
    ]
    cfg = load(ProxyConfig, env({"backends": backends}, POLAR_ENGINE_API_KEY="pe_env"))
    keys = {b.name: http_key(b.settings) for b in cfg.backends}
    assert keys == {"gpu": None, "cpu": "pe_env"}


def test_a_key_in_the_backend_settings_wins():
    backend = {"kind": "embedded", "settings": {"http": {"api_key": "pe_cfg", "timeout_s": 5}}}
    cfg = load(ProxyConfig, env({"backend": backend}, POLAR_ENGINE_API_KEY="pe_env"))
    assert cfg.engine().settings["http"] == {"api_key": "pe_cfg", "timeout_s": 5}
    # one embedded entry names a key: the group's (one pool merges their settings)
    backends = [
        {"name": "a", "kind": "embedded", "url": "http://m0:30000"},
        {"name": "b", "kind": "embedded", "url": "http://m1:30000",
         "settings": {"http": {"api_key": "pe_cfg"}}},
    ]  # fmt: skip
    cfg = load(ProxyConfig, env({"backends": backends}, POLAR_ENGINE_API_KEY="pe_env"))
    assert http_key(cfg.engine().settings) == "pe_cfg"


def test_other_http_settings_are_kept_beside_the_key():
    backend = {"kind": "embedded", "settings": {"http": {"timeout_s": 5}}}
    cfg = load(ProxyConfig, env({"backend": backend}, POLAR_ENGINE_API_KEY="pe_env"))
    assert cfg.engine().settings["http"] == {"timeout_s": 5, "api_key": "pe_env"}


def test_without_the_variable_the_backends_are_unchanged():
    cfg = load(ProxyConfig, env())
    assert cfg.backend.settings == {}


def _model_service(monkeypatch, config: dict, key: str | None):
    from services.engine.main import create_app
    from tests.unit.engine.tiny import tiny_model_dir

    monkeypatch.setenv("POLAR_CONFIG", json.dumps({"model_dir": str(tiny_model_dir()), **config}))
    if key is None:
        monkeypatch.delenv("POLAR_ENGINE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("POLAR_ENGINE_API_KEY", key)
    return TestClient(create_app())


def test_the_model_service_takes_its_key_from_the_environment(monkeypatch):
    with _model_service(monkeypatch, {}, "pe_env") as client:
        assert client.get("/get_weight_version").status_code == 401
        keyed = {"authorization": "Bearer pe_env"}
        assert client.get("/get_weight_version", headers=keyed).status_code == 200
        assert client.get("/healthz").status_code == 200


def test_the_model_service_config_key_wins(monkeypatch):
    with _model_service(monkeypatch, {"api_key": "pe_cfg"}, "pe_env") as client:
        env_key = {"authorization": "Bearer pe_env"}
        assert client.get("/get_weight_version", headers=env_key).status_code == 401
        cfg_key = {"authorization": "Bearer pe_cfg"}
        assert client.get("/get_weight_version", headers=cfg_key).status_code == 200


def test_polar_up_services_do_not_inherit_the_operators_tokens():
    from infra.devstack import inherited_env

    shell = {"PATH": "/usr/bin", "POLAR_NATS_URL": "nats://x:4222", **ENV}
    shell["POLAR_ENGINE_API_KEY"] = "pe_other_stack"
    assert inherited_env(shell) == {"PATH": "/usr/bin", "POLAR_NATS_URL": "nats://x:4222"}


def test_the_evaluator_alone_gets_the_stack_engine_key_for_a_judge():
    """The rubric judge calling the stack's own engine got a 401 (issue 38.15): `polar up`
    gives the evaluator the engine key as POLAR_ENGINE_API_KEY, and no other service."""
    from infra import credentials
    from infra.devstack import _judge_key
    from infra.topology import ServicePlan

    creds = credentials.generate(["evaluator"], own_nats=True, own_redis=True)
    plan = lambda service: ServicePlan(name=service, service=service, port=0, config={})  # noqa: E731
    assert _judge_key(plan("evaluator"), creds) == {"POLAR_ENGINE_API_KEY": creds.engine_key}
    assert _judge_key(plan("scheduler"), creds) == {} == _judge_key(plan("pool"), creds)


def test_a_stacks_node_services_install_clis_into_the_users_cache(tmp_path):
    """`polar up`'s pool installed every CLI again into its state dir (issue 38.9): the
    node services get the per-user cache `just setup` fills, unless one is named."""
    from infra.devstack import _shared_harness_cache
    from infra.topology import ServicePlan

    plan = lambda service: ServicePlan(name=service, service=service, port=0, config={})  # noqa: E731
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    cache = {"POLAR_HARNESS_CACHE": str(tmp_path / "polar" / "harness-cache")}
    assert _shared_harness_cache(plan("pool"), env) == cache
    assert _shared_harness_cache(plan("executor"), env) == cache
    assert _shared_harness_cache(plan("scheduler"), env) == {}
    assert _shared_harness_cache(plan("pool"), {**env, "POLAR_HARNESS_CACHE": "/mine"}) == {}
    assert _shared_harness_cache(plan("pool"), {"POLAR_CACHE_DIR": "none"}) == {}
