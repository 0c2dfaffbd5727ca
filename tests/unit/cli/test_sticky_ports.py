"""StickyPorts: `port: 0` gets the port it had at the stack's last start when free."""

import socket

from infra.localservers import StickyPorts


def test_a_second_start_gets_the_same_ports(tmp_path):
    first = StickyPorts(tmp_path)
    chosen = {name: first(name) for name in ("nats", "redis", "proxy")}
    assert len(set(chosen.values())) == 3
    first.save()
    again = StickyPorts(tmp_path)
    assert {name: again(name) for name in chosen} == chosen


def test_a_port_taken_meanwhile_is_replaced_and_the_new_one_remembered(tmp_path):
    first = StickyPorts(tmp_path)
    old = first("proxy")
    first.save()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", old))
        squatter.listen()
        again = StickyPorts(tmp_path)
        new = again("proxy")
    assert new != old
    again.save()
    assert StickyPorts(tmp_path).kept["proxy"] == new


def test_two_names_never_share_a_remembered_port(tmp_path):
    (tmp_path / StickyPorts.FILE).write_text('{"nats": 1, "redis": 1}')
    ports = StickyPorts(tmp_path)
    (tmp_path / StickyPorts.FILE).unlink()
    a, b = ports("nats"), ports("redis")
    assert a != b


def test_an_unreadable_record_is_a_fresh_start(tmp_path):
    (tmp_path / StickyPorts.FILE).write_text("not json")
    assert StickyPorts(tmp_path).kept == {}
    (tmp_path / StickyPorts.FILE).write_text('["a list"]')
    assert StickyPorts(tmp_path).kept == {}
