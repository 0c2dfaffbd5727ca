from pathlib import Path

import msgspec
import pytest

from infra.catalog import SERVICES, ServiceKind, check_catalog
from infra.topology import (
    Node,
    Topology,
    TopologyError,
    load_topology,
    node_specs,
    parse_topology,
    plan_services,
)
from infra.wiring import cannot_work
from services.common.settings import (
    DEFAULT_NATS_URL,
    DEFAULT_REDIS_URL,
    Retention,
    StreamLimits,
)

REPO = Path(__file__).resolve().parents[3]

CATALOG = {
    "scheduler": ServiceKind("services.scheduler.main:create_app", 8100),
    "pool": ServiceKind(
        "x.pool:create_app", 8200, per_node=True, takes=("max_init", "ready_buffer")
    ),
    "proxy": ServiceKind("x.proxy:create_app", 8300, takes=("backends",)),
}


def test_empty_file_is_all_defaults():
    for raw in ("", "{}", "# nothing\n"):
        topo = parse_topology(raw)
        assert topo == Topology()
    topo = Topology()
    assert (topo.nats_url, topo.redis_url) == (DEFAULT_NATS_URL, DEFAULT_REDIS_URL)
    assert topo.state_dir == ".state"
    assert node_specs(topo) == [Node(name="node0")]


def test_no_file_means_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_topology(None) == Topology()
    (tmp_path / "topology.yaml").write_text("nats_url: nats://127.0.0.1:5999\n")
    assert load_topology(None).nats_url == "nats://127.0.0.1:5999"


def test_missing_named_file_is_an_error(tmp_path):
    with pytest.raises(TopologyError, match="cannot read topology"):
        load_topology(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ("nats_ulr: nats://x\n", "nats_ulr"),
        ("services: {scheduler: {prot: 1}}\n", "prot"),
        ("nodes: [{name: a, max_runs: 3}]\n", "max_runs"),
        ("backends: [{name: a, urll: http://x}]\n", "urll"),
    ],
)
def test_unknown_key_is_an_error_naming_it(raw, named):
    with pytest.raises(TopologyError, match=f"unknown field `{named}`"):
        parse_topology(raw, "topo.yaml")


def test_unknown_service_and_bad_values_are_errors():
    with pytest.raises(TopologyError, match=r"unknown service\(s\) \['schedular'\]"):
        parse_topology("services: {schedular: {}}\n")
    with pytest.raises(TopologyError, match=r"Expected `int \| null`, got `str`"):
        parse_topology("services: {scheduler: {port: high}}\n")
    with pytest.raises(TopologyError, match="not valid YAML"):
        parse_topology("services: [\n")
    with pytest.raises(TopologyError, match="duplicate node names"):
        parse_topology("nodes: [a, {name: a}]\n")
    with pytest.raises(TopologyError, match="at least one node"):
        parse_topology("nodes: []\n")


def test_nodes_by_name_or_with_pool_sizes():
    topo = parse_topology("nodes: [a, {name: b, max_run: 2}]\n")
    assert node_specs(topo) == [Node(name="a"), Node(name="b", max_run=2)]


def test_example_topology_parses_and_plans():
    topo = load_topology(REPO / "topology.example.yaml")
    plans = plan_services(topo)
    expected = [
        f"{n}-node0" if k.per_node else n
        for n, k in SERVICES.items()
        if n != "model" and not k.opt_in
    ]
    assert [p.name for p in plans] == expected  # an external engine: no embedded model
    assert cannot_work(plans) == []  # token mode with its model_dir
    sched = next(p for p in plans if p.name == "scheduler")
    assert sched.port == 8100 and sched.config["reconcile_interval_seconds"] == 5.0


def test_plan_defaults_one_process_per_service():
    plans = plan_services(Topology(), CATALOG)
    assert [(p.name, p.port) for p in plans] == [
        ("scheduler", 8100),
        ("pool-node0", 8200),
        ("proxy", 8300),
    ]


def test_plan_per_node_services_get_their_node_and_sizes():
    topo = parse_topology("nodes: [{name: a, max_init: 7}, {name: b, ready_buffer: 9}]\n")
    pools = [p for p in plan_services(topo, CATALOG) if p.service == "pool"]
    assert [(p.name, p.port, p.config["node"]) for p in pools] == [
        ("pool-a", 8200, "a"),
        ("pool-b", 8201, "b"),
    ]
    assert (pools[0].config["max_init"], pools[1].config["ready_buffer"]) == (7, 9)
    assert "max_run" not in pools[0].config  # only the fields the service takes


def test_plan_config_stack_keys_win_and_only_taken_fields_pass():
    topo = parse_topology(
        """
nats_url: nats://127.0.0.1:1
redis_url: redis://127.0.0.1:2/0
backends: [{name: gpu, url: "http://h:3"}]
services:
  scheduler: {port: 9000, config: {port: 1, nats_url: nats://elsewhere, reconcile_interval_seconds: 0.5}}
  pool: {enabled: false}
  proxy: {port: 0}
""",
        catalog=CATALOG,
    )
    plans = {p.name: p for p in plan_services(topo, CATALOG)}
    assert set(plans) == {"scheduler", "proxy"}
    sched = plans["scheduler"].config
    assert sched == {
        "reconcile_interval_seconds": 0.5,
        "nats_url": "nats://127.0.0.1:1",
        "redis_url": "redis://127.0.0.1:2/0",
        "nats_replicas": 1,
        "retention": {"finished_seconds": 7 * 24 * 3600.0, "streams": {}},
        "host": "127.0.0.1",
        "port": 9000,
        "node": "node0",
    }
    assert plans["proxy"].port == 0
    assert plans["proxy"].config["backends"] == [
        {"name": "gpu", "kind": "sglang", "url": "http://h:3", "model": None, "settings": {}}
    ]


def test_the_retention_policy_reaches_every_service_and_is_checked():
    topo = parse_topology(
        "retention: {finished_seconds: 60, streams: {POLAR_EVENTS: {max_bytes: 1000}}}\n",
        catalog=CATALOG,
    )
    plans = plan_services(topo, CATALOG)
    assert plans and all(
        msgspec.convert(p.config["retention"], Retention).limits("POLAR_EVENTS")
        == StreamLimits(max_bytes=1000)
        for p in plans
    )
    with pytest.raises(Exception, match="no stream POLAR_EVENT"):
        parse_topology("retention: {streams: {POLAR_EVENT: {max_bytes: 1}}}\n", catalog=CATALOG)


def test_catalog_rows_are_well_formed():
    check_catalog(SERVICES)
    with pytest.raises(ValueError, match="unknown `takes`"):
        check_catalog({"x": ServiceKind("m:f", 1, takes=("max_ran",))})
    with pytest.raises(ValueError, match="not 'module:callable'"):
        check_catalog({"x": ServiceKind("m.f", 1)})


def test_an_opt_in_service_runs_only_when_the_topology_names_it():
    assert "trainer" not in [p.name for p in plan_services(Topology())]
    topo = parse_topology("services: {trainer: {config: {run_id: r}}}\n")
    (plan,) = [p for p in plan_services(topo) if p.service == "trainer"]
    assert plan.port == 8150 and plan.config["run_id"] == "r"
    off = parse_topology("services: {trainer: {enabled: false}}\n")
    assert "trainer" not in [p.name for p in plan_services(off)]
