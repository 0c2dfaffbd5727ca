"""The deployment files of infra/deploy/ checked without running them (the runs are in
tests/deploy): the Kubernetes manifests against the Kubernetes API schemas (strict:
unknown fields fail), every service's POLAR_CONFIG in the manifests and in the compose
file against that service's own settings type (they reject unknown keys, so a typo
would only show when the pod starts), the credentials each service must hold (from the
Secret polar-tokens, compose's required variables, the Slurm job's environment) and
that the gateways hold none, the JetStream cluster, Valkey and Sentinel sizes, and the Slurm
templates' shell syntax."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from proxy.config import ProxyConfig
from services.builder.config import BuilderConfig
from services.common.endpoints import nats_servers, parse_redis
from services.common.settings import load
from services.dashboard.config import DashboardConfig
from services.engine.main import service_config
from services.evaluator.config import EvaluatorConfig
from services.executor.config import ExecutorConfig
from services.pool.config import PoolConfig
from services.scheduler.config import SchedulerConfig

DEPLOY = Path(__file__).resolve().parents[2] / "infra/deploy"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
SETTINGS = {
    "builder": BuilderConfig,
    "dashboard": DashboardConfig,
    "evaluator": EvaluatorConfig,
    "executor": ExecutorConfig,
    "pool": PoolConfig,
    "scheduler": SchedulerConfig,
    "proxy": ProxyConfig,
}
# what Kubernetes substitutes for $(VAR) in an env value, for the check
K8S_VARS = {"POD_NAME": "gateway-0", "REDIS_PASSWORD": "secret"}
# the token variables and what each service does with them (docs/explanation/security.md): the
# scheduler and dashboard check admin and read, the proxy checks admin and presents the
# engine key, the model checks that key; the rest, the gateways' harnesses above all,
# must hold none
TOKEN_VARS = {
    "admin": "POLAR_ADMIN_TOKEN",
    "read": "POLAR_READ_TOKEN",
    "engine": "POLAR_ENGINE_API_KEY",
}
NEEDS = {
    "scheduler": {"admin", "read"},
    "dashboard": {"admin", "read"},
    "proxy": {"admin", "engine"},
    "model": {"engine"},
}


def k8s_docs() -> list[dict]:
    return [d for f in K8S for d in yaml.safe_load_all(f.read_text()) if d]


def kind(name: str) -> list[dict]:
    return [d for d in k8s_docs() if d["kind"] == name]


def check_service_config(service: str, env: dict[str, str]) -> None:
    """``env`` is what the service's process sees; it must load as its settings, and
    those hold the tokens the service needs (each its variable's value in ``env``)."""
    needs = NEEDS.get(service, set())
    given = {role for role, var in TOKEN_VARS.items() if var in env}
    assert given == needs, f"{service}: given {sorted(given)}, needs {sorted(needs)}"
    if service == "model":  # the engine's own settings, minus the stack's keys
        assert service_config(env).api_key == env["POLAR_ENGINE_API_KEY"]
        return
    cfg = load(SETTINGS[service], env)
    if "admin" in needs:
        assert cfg.admin_token == env["POLAR_ADMIN_TOKEN"], service
    if "read" in needs:
        assert cfg.read_token == env["POLAR_READ_TOKEN"], service
    if "engine" in needs:  # the proxy presents the model service's key to its engine
        assert cfg.engine().kind == "embedded"
        assert cfg.engine().settings["http"]["api_key"] == env["POLAR_ENGINE_API_KEY"]


@pytest.mark.parametrize("path", K8S, ids=lambda p: p.name)
def test_k8s_manifests_match_the_kubernetes_schemas(path):
    kv = pytest.importorskip(
        "kubernetes_validate", reason="needs kubernetes-validate (pip install kubernetes-validate)"
    )
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            kv.validate(doc, "1.37.0", strict=True)


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def secrets() -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["stringData"] for d in kind("Secret")}


def test_k8s_secret_polar_tokens_holds_placeholders_only():
    tokens = secrets()["polar-tokens"]
    assert set(tokens) == set(TOKEN_VARS)
    # a placeholder to replace (the file says how), never a usable shared default
    assert set(tokens.values()) == {"change-me"}


def test_k8s_every_service_container_config_loads():
    common = kind("ConfigMap")[0]["data"]
    # distinct values, so a variable bound to the wrong key shows
    stored = {
        "valkey": {"password": "secret"},
        "polar-tokens": {r: f"{r}-value" for r in TOKEN_VARS},
    }
    assert {n: set(v) for n, v in secrets().items()} == {n: set(v) for n, v in stored.items()}
    seen = set()
    for workload in kind("Deployment") + kind("StatefulSet"):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            if c["command"][:2] != ["polar", "serve"]:
                continue  # nats-server, valkey, sentinels
            env = {**common, **K8S_VARS}
            for e in c.get("env", []):
                if "value" in e:
                    env[e["name"]] = _expand(e["value"], env)
                elif ref := e["valueFrom"].get("secretKeyRef"):
                    env[e["name"]] = stored[ref["name"]][ref["key"]]
            for role, var in TOKEN_VARS.items():  # each token from its own key
                assert env.get(var, f"{role}-value") == f"{role}-value", (c["name"], var)
            assert "$(" not in env["POLAR_CONFIG"], env["POLAR_CONFIG"]
            check_service_config(c["command"][2], env)
            seen.add(c["command"][2])
    assert seen == {*SETTINGS, "model"}


def test_k8s_backbone_is_a_3_node_jetstream_cluster_and_valkey_with_sentinels():
    sets = {s["metadata"]["name"]: s for s in kind("StatefulSet")}
    nats = sets["nats"]
    assert nats["spec"]["replicas"] == 3
    command = nats["spec"]["template"]["spec"]["containers"][0]["command"]
    routes = command[command.index("--routes") + 1].split(",")
    assert routes == [f"nats://nats-{i}.nats:6222" for i in range(3)]
    common = kind("ConfigMap")[0]["data"]
    assert len(nats_servers(common["POLAR_NATS_URL"])) == 3
    assert common["POLAR_NATS_REPLICAS"] == "3"
    assert sets["valkey"]["spec"]["replicas"] == 3  # a primary and two replicas
    # any pod may be promoted, so each takes writes only with a replica following it
    # (one, so losing any one pod leaves a primary that still takes writes)
    valkey = sets["valkey"]["spec"]["template"]["spec"]["containers"][0]["command"][2].split()
    assert valkey[valkey.index("--min-replicas-to-write") + 1] == "1"
    assert 0 < int(valkey[valkey.index("--min-replicas-max-lag") + 1]) <= 10
    assert sets["valkey-sentinel"]["spec"]["replicas"] == 3
    script = sets["valkey-sentinel"]["spec"]["template"]["spec"]["containers"][0]["command"][2]
    assert "sentinel monitor polar valkey-0.valkey 6379 2" in script  # quorum 2 of 3
    redis_url = next(
        e["value"]
        for d in kind("Deployment")
        for e in d["spec"]["template"]["spec"]["containers"][0]["env"]
        if e["name"] == "POLAR_REDIS_URL"
    )
    endpoint = parse_redis(_expand(redis_url, K8S_VARS))
    assert endpoint.via_sentinel and len(endpoint.sentinels) == 3


# what the compose test's shell exports (each value distinct: a swapped variable shows)
COMPOSE_ENV = {var: f"{role}-value" for role, var in TOKEN_VARS.items()}


def _interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` and ``${VAR:?message}`` with COMPOSE_ENV set."""
    value = re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", value)
    return re.sub(r"\$\{(\w+):\?[^}]*\}", lambda m: COMPOSE_ENV[m.group(1)], value)


def test_compose_tokens_have_no_default():
    text = (DEPLOY / "compose/compose.yaml").read_text()
    for var in TOKEN_VARS.values():
        uses = re.findall(r"\$\{" + var + r"([^}]*)\}", text)
        assert uses and all(u.startswith(":?") for u in uses), (var, uses)


def test_compose_every_service_config_loads():
    compose = yaml.safe_load((DEPLOY / "compose/compose.yaml").read_text())
    seen = set()
    for name, svc in compose["services"].items():
        env = {k: str(v) for k, v in svc.get("environment", {}).items()}
        env = {k: _interpolate(v) for k, v in env.items()}
        command = svc["command"]
        if command[:2] == ["polar", "serve"]:
            check_service_config(command[2], env)
            seen.add(command[2])
        elif name == "gateway":  # one node's pool, executor and evaluator, each its own config
            nodes = set()
            for service in ("pool", "executor", "evaluator"):
                service_env = {**env, "POLAR_CONFIG": env[f"{service.upper()}_CONFIG"]}
                check_service_config(service, service_env)
                cfg = load(SETTINGS[service], service_env)
                nodes.add((cfg.node, cfg.work_dir))
                seen.add(service)
            assert nodes == {("gateway-1", "/data/work")}  # its evaluator reaches its runtimes
    assert seen == {*SETTINGS, "model"}


def test_k8s_each_gateway_pod_evaluates_its_own_sessions():
    """Node-affine evaluation: a runtime a session left for its evaluation is on its
    gateway pod's /work, so each gateway pod runs an evaluator of that node."""
    (gateway,) = [w for w in kind("StatefulSet") if w["metadata"]["name"] == "gateway"]
    containers = {c["name"]: c for c in gateway["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"pool", "executor", "evaluator"}
    for c in containers.values():
        config = next(e["value"] for e in c["env"] if e["name"] == "POLAR_CONFIG")
        assert '"node": "$(POD_NAME)"' in config and '"work_dir": "/work"' in config, c["name"]
        assert {"name": "work", "mountPath": "/work"} in c["volumeMounts"]


@pytest.mark.parametrize(
    "script",
    sorted((DEPLOY / "slurm").glob("*")) + sorted((DEPLOY / "container").glob("*.sh")),
    ids=lambda p: p.name,
)
def test_deploy_scripts_parse(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_podman_pods_play_each_replica_under_its_kubernetes_dns_names():
    from infra.deploy.k8s.podman_pods import load, pod_commands

    cmds = pod_commands(load(), "img", "t")
    pods = {c[c.index("--name") + 1]: c for c in cmds if c[:3] == ["podman", "pod", "create"]}
    assert [p for p in pods if p.startswith("t-nats-")] == ["t-nats-0", "t-nats-1", "t-nats-2"]
    assert list(pods)[:3] == ["t-nats-0", "t-nats-1", "t-nats-2"]  # the backbone first

    def alias(pod: str) -> list[str]:
        args = pods[pod]
        return [a for i, a in enumerate(args) if args[i - 1] == "--network-alias"]

    assert alias("t-nats-1") == ["nats-1.nats"]
    assert alias("t-proxy-0") == alias("t-proxy-1") == ["proxy"]  # a Service: every replica
    runs = {c[c.index("--name") + 1]: c for c in cmds if c[:2] == ["podman", "run"]}
    pool = runs["t-gateway-1-pool"]
    config = next(a for a in pool if a.startswith("POLAR_CONFIG="))
    assert '"node": "gateway-1"' in config  # $(POD_NAME) expanded
    for container in ("pool", "executor", "evaluator"):
        assert "t-gateway-1-work:/work" in runs[f"t-gateway-1-{container}"], container
    nats = runs["t-nats-2-nats"]
    assert nats[nats.index("--server_name") + 1] == "nats-2"


def test_the_token_file_is_private_fresh_and_kept(tmp_path):
    from infra.deploy.tokens import ensure

    path = tmp_path / "compose/tokens.env"
    assert ensure(path)
    assert path.stat().st_mode & 0o777 == 0o600
    values = dict(line.split("=", 1) for line in path.read_text().splitlines())
    assert set(values) == set(TOKEN_VARS.values())
    assert values["POLAR_ADMIN_TOKEN"].startswith("pa_") and len(set(values.values())) == 3
    before = path.read_text()
    assert not ensure(path)  # a restarted stack keeps the tokens its clients hold
    assert path.read_text() == before
