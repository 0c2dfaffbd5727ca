import pytest

from infra.topology import parse_topology, plan_services
from services.common.bus import STREAMS, replicated
from services.common.endpoints import EndpointError, nats_servers, parse_redis
from services.common.settings import ConfigError, ServiceSettings, load


def test_nats_list_takes_the_first_servers_scheme_and_credentials():
    assert nats_servers("nats://127.0.0.1:4222") == ["nats://127.0.0.1:4222"]
    assert nats_servers("nats://svc:pw@a:4222, b:4223,tls://c:4224") == [
        "nats://svc:pw@a:4222",
        "nats://svc:pw@b:4223",
        "tls://svc:pw@c:4224",
    ]
    assert nats_servers("nats://u:1@a:1,nats://v:2@b:2") == ["nats://u:1@a:1", "nats://v:2@b:2"]
    with pytest.raises(EndpointError, match="no server"):
        nats_servers(" , ")


def test_redis_one_server():
    ep = parse_redis("rediss://user:p%40ss@cache.local:6380/2")
    assert (ep.host, ep.port, ep.db, ep.username, ep.password, ep.tls) == (
        "cache.local", 6380, 2, "user", "p@ss", True,
    )  # fmt: skip
    assert not ep.via_sentinel
    assert parse_redis("redis://:secret@h").password == "secret"
    with pytest.raises(EndpointError, match="redis\\+sentinel"):
        parse_redis("redis://a:6379,b:6379/0")
    with pytest.raises(EndpointError, match="scheme"):
        parse_redis("unix:///tmp/redis.sock")


def test_redis_sentinel_url():
    ep = parse_redis("redis+sentinel://:pw@s1:26379,s2,[::1]:26380/polar/3?sentinel_password=sp")
    assert ep.via_sentinel and ep.master == "polar" and ep.db == 3
    assert ep.sentinels == (("s1", 26379), ("s2", 26379), ("::1", 26380))
    assert (ep.password, ep.sentinel_password) == ("pw", "sp")
    for bad in ("redis+sentinel://s1:26379", "redis+sentinel:///polar", "redis+sentinel://s:x/m"):
        with pytest.raises(EndpointError):
            parse_redis(bad)


def test_streams_take_the_replica_count():
    assert {cfg.num_replicas for cfg in replicated(STREAMS, 3)} == {3}
    assert [c.name for c in replicated(STREAMS, 3)] == [c.name for c in STREAMS]
    with pytest.raises(ValueError, match="1..5"):
        replicated(STREAMS, 0)


def test_replicas_flow_from_topology_and_env():
    topo = parse_topology("nats_replicas: 3\nnats_url: nats://a:4222,nats://b:4222\n")
    plans = plan_services(topo)
    assert plans and all(p.config["nats_replicas"] == 3 for p in plans)
    assert load(ServiceSettings, {"POLAR_NATS_REPLICAS": "3"}).nats_replicas == 3
    with pytest.raises(ConfigError, match="POLAR_NATS_REPLICAS"):
        load(ServiceSettings, {"POLAR_NATS_REPLICAS": "three"})
