"""infra.wiring: the addresses `polar up` gives each service, as plain functions."""

import itertools
from pathlib import Path

from infra.topology import parse_topology, plan_services
from infra.wiring import connect_host, explicit_port, wire, with_port, with_ports, with_server_ports

STATE = Path("/srv/polar-state")


def ports_from(first: int):
    counter = itertools.count(first)
    return lambda name: next(counter)


def planned(raw: str, first_free: int = 40000):
    topo = parse_topology(raw)
    topo = with_server_ports(topo, ports_from(first_free + 100))
    return topo, wire(with_ports(plan_services(topo), ports_from(first_free)), topo, STATE)


def by_name(plans):
    return {p.name: p for p in plans}


def test_port_zero_on_proxy_and_model_reaches_every_service_that_needs_it():
    _, plans = planned(
        """
services: {proxy: {port: 0}, model: {port: 0}}
nodes: [a, b]
backends: [{name: gpu, kind: sglang, url: 'http://10.0.0.5:30000'}, {name: cpu, kind: embedded}]
"""
    )
    p = by_name(plans)
    model, proxy = p["model"].port, p["proxy"].port
    assert {model, proxy} <= set(range(40000, 40010)) and model != proxy
    for name in ("pool-a", "pool-b", "executor-a", "executor-b", "evaluator"):
        assert p[name].config["proxy_url"] == f"http://127.0.0.1:{proxy}", name
        assert p[name].config["work_dir"] == str(STATE / "work")
    embedded = f"http://127.0.0.1:{model}"
    for name in ("proxy", "pool-a", "pool-b"):  # the proxy uses them, the pools watch them
        assert [b["url"] for b in p[name].config["backends"]] == ["http://10.0.0.5:30000", embedded]
    assert "proxy_url" not in p["scheduler"].config and "proxy_url" not in p["builder"].config
    # one machine, one work dir: the evaluator reaches both nodes' runtimes
    assert p["evaluator"].config["nodes"] == ["a", "b"]


def test_default_ports_are_wired_too():
    _, plans = planned("{}")
    p = by_name(plans)
    assert p["executor-node0"].config["proxy_url"] == "http://127.0.0.1:8200"
    # no `backends`: the proxy's default backend is the stack's model service
    assert p["proxy"].config["backend"] == {"kind": "embedded", "urls": ["http://127.0.0.1:30000"]}


def test_what_the_user_set_wins():
    _, plans = planned(
        """
services:
  proxy: {port: 0, config: {backend: {kind: sglang, urls: ['http://gpu:1']}}}
  model: {port: 0}
  executor: {config: {proxy_url: 'http://gateway:9', work_dir: /shared/work}}
"""
    )
    p = by_name(plans)
    assert p["executor-node0"].config["proxy_url"] == "http://gateway:9"
    assert p["executor-node0"].config["work_dir"] == "/shared/work"
    assert p["pool-node0"].config["proxy_url"] == f"http://127.0.0.1:{p['proxy'].port}"
    assert p["proxy"].config["backend"] == {"kind": "sglang", "urls": ["http://gpu:1"]}


def test_without_the_model_or_proxy_nothing_is_invented():
    _, plans = planned(
        """
services: {proxy: {enabled: false}, model: {enabled: false}}
backends: [{kind: sglang}]
"""
    )
    p = by_name(plans)
    assert "proxy_url" not in p["pool-node0"].config  # an external proxy: the node's default
    assert p["pool-node0"].config["backends"][0]["url"] is None


def test_the_listen_host_becomes_a_host_clients_reach():
    _, plans = planned("host: 0.0.0.0\nservices: {proxy: {port: 0}}")
    proxy = by_name(plans)["proxy"].port
    assert by_name(plans)["pool-node0"].config["proxy_url"] == f"http://127.0.0.1:{proxy}"
    assert connect_host("10.1.2.3") == "10.1.2.3" and connect_host("") == "127.0.0.1"


def test_nats_and_redis_port_zero_get_a_free_port_every_service_is_given():
    topo, plans = planned(
        "nats_url: nats://127.0.0.1:0\nredis_url: redis://user:pw@127.0.0.1:0/3\n"
    )
    assert topo.nats_url == "nats://127.0.0.1:40100"
    assert topo.redis_url == "redis://user:pw@127.0.0.1:40101/3"
    for p in plans:
        assert (p.config["nats_url"], p.config["redis_url"]) == (topo.nats_url, topo.redis_url)
    unchanged = parse_topology("nats_url: nats://127.0.0.1:4333")
    assert with_server_ports(unchanged, ports_from(1)) is unchanged


def test_url_ports():
    assert explicit_port("nats://127.0.0.1:0") == 0
    assert explicit_port("nats://127.0.0.1") is None
    assert explicit_port("127.0.0.1:4222") == 4222
    assert with_port("redis://[::1]:0/0", 7) == "redis://[::1]:7/0"


def test_token_mode_without_a_tokenizer_cannot_work():
    from infra.wiring import cannot_work

    _, plans = planned("backends: [{kind: sglang, url: 'http://gpu:30000'}]")
    (why,) = cannot_work(plans)
    assert "token mode" in why and "sglang at http://gpu:30000" in why
    assert "services.proxy.config.model_dir" in why and "mode: chat" in why
    for fix in (
        "services: {proxy: {config: {model_dir: /models/qwen}}}",
        "services: {proxy: {config: {mode: chat}}}",
    ):
        _, plans = planned(f"backends: [{{kind: sglang, url: 'http://gpu:30000'}}]\n{fix}")
        assert cannot_work(plans) == [], fix
    _, plans = planned("{}")  # the embedded engine: its tokenizer is known
    assert cannot_work(plans) == []
    _, plans = planned("services: {proxy: {config: {mode: tito}}}")
    assert cannot_work(plans) == ["services.proxy.config.mode is 'tito': use token or chat"]
    _, plans = planned("services: {proxy: {enabled: false}}\nbackends: [{kind: vllm}]")
    assert cannot_work(plans) == []  # no proxy of ours: nothing to check


def test_the_proxy_templates_with_the_embedded_engines_own_model_dir():
    _, plans = planned("services: {model: {config: {model_dir: /models/mine}}}")
    assert by_name(plans)["proxy"].config["model_dir"] == "/models/mine"
    _, plans = planned(
        "services: {model: {config: {model_dir: /models/mine}}}\n"
        "backends: [{kind: sglang, url: 'http://gpu:1'}]"
    )
    assert "model_dir" not in by_name(plans)["proxy"].config  # not the embedded engine


def test_the_trainer_pushes_weights_to_the_stacks_proxy():
    _, plans = planned(
        """
services:
  proxy: {port: 0}
  trainer: {config: {model_dir: /m}}
"""
    )
    p = by_name(plans)
    assert p["trainer"].config["proxy_url"] == f"http://127.0.0.1:{p['proxy'].port}"
    assert "work_dir" not in p["trainer"].config  # its config has no such field


def test_the_dashboard_is_told_where_the_record_tokenizer_and_trainer_log_are():
    _, plans = planned(
        """
services:
  proxy: {config: {model_dir: /models/m}}
  trainer: {config: {checkpoint_dir: /ckpt}}
backends: [{name: gpu, kind: sglang, url: 'http://10.0.0.5:30000'}]
"""
    )
    cfg = by_name(plans)["dashboard"].config
    assert cfg["state_dir"] == str(STATE)
    assert cfg["model_dir"] == "/models/m"
    assert cfg["trainer_log"] == "/ckpt/log.jsonl"
    assert cfg["backends"][0]["url"] == "http://10.0.0.5:30000"  # engines' queues shown
    _, plans = planned("services: {model: {enabled: false}, proxy: {enabled: false}}")
    assert "model_dir" not in by_name(plans)["dashboard"].config  # ids shown undecoded


def test_each_service_gets_the_tokens_it_checks_or_presents():
    from infra.credentials import generate, with_userinfo
    from infra.wiring import with_credentials

    _, plans = planned(
        """
services:
  trainer: {config: {model_dir: /m}}
  scheduler: {config: {read_token: mine}}
"""
    )
    creds = generate(["scheduler", "cli"], own_nats=True, own_redis=True)
    p = by_name(with_credentials(plans, creds))
    assert p["scheduler"].config["admin_token"] == creds.admin_token
    assert p["scheduler"].config["read_token"] == "mine"  # what the user set wins
    assert p["proxy"].config["admin_token"] == p["trainer"].config["admin_token"]
    assert p["dashboard"].config["admin_token"] == creds.admin_token  # its cancel needs it
    assert p["dashboard"].config["read_token"] == creds.read_token  # every read needs it
    assert "admin_token" not in p["pool-node0"].config and "admin_token" not in p["builder"].config
    assert creds.nats_url("nats://h:4222", "scheduler").startswith("nats://scheduler:")
    assert creds.nats_url("nats://h:4222", "nobody") == "nats://h:4222"
    assert creds.redis_url("redis://h:1/0") == f"redis://:{creds.redis_password}@h:1/0"
    assert with_userinfo("redis://old:pw@h:1/0", "u", "p/@") == "redis://u:p%2F%40@h:1/0"


def test_the_engine_key_reaches_the_model_service_and_the_proxys_backends_at_it():
    """Issue 17: the stack's engine requires a key; the proxy presents it to that engine
    only (a remote engine gets none of it), and a key the user set wins."""
    from infra.credentials import generate
    from infra.wiring import with_credentials

    creds = generate(["cli"], own_nats=True, own_redis=True)
    assert creds.engine_key and creds.engine_key.startswith("pe_")
    _, plans = planned("services: {model: {port: 0}}")  # the proxy's default backend
    p = by_name(with_credentials(plans, creds))
    model_url = f"http://127.0.0.1:{p['model'].port}"
    assert p["model"].config["api_key"] == creds.engine_key
    backend = p["proxy"].config["backend"]
    assert backend["urls"] == [model_url]
    assert backend["settings"]["http"]["api_key"] == creds.engine_key
    for name in set(p) - {"model", "proxy"}:
        assert creds.engine_key not in str(p[name].config), name

    _, plans = planned(
        """
backends:
  - {name: gpu, kind: sglang, url: 'http://10.0.0.5:30000'}
  - {name: cpu, kind: embedded}
  - {name: own, kind: embedded, settings: {http: {api_key: mine, timeout_s: 5}}}
"""
    )
    backends = {
        b["name"]: b for b in by_name(with_credentials(plans, creds))["proxy"].config["backends"]
    }
    assert "api_key" not in str(backends["gpu"])  # not the stack's engine: not its key
    assert backends["cpu"]["settings"]["http"]["api_key"] == creds.engine_key
    assert backends["own"]["settings"]["http"] == {"api_key": "mine", "timeout_s": 5}
