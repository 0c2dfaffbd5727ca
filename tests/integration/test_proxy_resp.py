"""proxy.io.resp, the proxy's pipelined Redis client, against a real Valkey (and the session
lookup built on it)."""

import asyncio

import pytest

from infra import localservers
from proxy.capture import SessionStore
from proxy.io.resp import RedisReplyError, RedisUnavailable, Resp, Script
from proxy.sessions import SessionResolver
from schemas import subjects as S
from services.common.registry import Registry
from tests.helpers.stack import running_session


async def test_commands_pipeline_in_order_under_concurrency(redis_url, redis_client):
    r = Resp.from_url(redis_url)
    try:
        got = await asyncio.gather(*(r.call("INCR", "resp:n") for _ in range(200)))
        assert sorted(got) == list(range(1, 201))  # every reply matched its own command
        await r.call("RPUSH", "resp:l", b"a", b"\x00\xff", "c")
        assert await r.call("LRANGE", "resp:l", 0, -1) == [b"a", b"\x00\xff", b"c"]
        assert await r.call("GET", "resp:missing") is None
        with pytest.raises(RedisReplyError, match="WRONGTYPE"):
            await r.call("INCR", "resp:l")
        assert await r.call("INCR", "resp:n") == 201  # an error reply leaves the pipe in step
    finally:
        await r.aclose()
        await redis_client.delete("resp:n", "resp:l")


async def test_script_loads_itself_after_a_flush(redis_url, redis_client):
    r = Resp.from_url(redis_url)
    script = Script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    try:
        await redis_client.script_flush()
        assert await r.script(script, ["resp:s"], [5]) == 5  # NOSCRIPT -> EVAL
        assert await r.script(script, ["resp:s"], [2]) == 7  # EVALSHA now
    finally:
        await r.aclose()
        await redis_client.delete("resp:s")


async def test_a_dropped_connection_fails_in_flight_and_reconnects(redis_url, redis_client):
    r = Resp.from_url(redis_url)
    try:
        await r.call("SET", "resp:k", "1")
        conn_id = await r.call("CLIENT", "ID")
        blocked = asyncio.ensure_future(r.call("BLPOP", "resp:never", 5))
        await asyncio.sleep(0.1)
        await redis_client.client_kill_filter(_id=conn_id)
        with pytest.raises(RedisUnavailable):
            await blocked
        assert await r.call("GET", "resp:k") == b"1"  # a fresh connection
    finally:
        await r.aclose()
        await redis_client.delete("resp:k")


async def test_db_from_the_url_and_an_unreachable_server(redis_url, redis_client):
    r = Resp.from_url(redis_url.rsplit("/", 1)[0] + "/3")
    try:
        await r.call("SET", "resp:db", "3")
        assert await redis_client.get("resp:db") is None  # not in db 0
        assert await r.call("GET", "resp:db") == b"3"
        await r.call("DEL", "resp:db")
    finally:
        await r.aclose()
    dead = Resp.from_url(f"redis://127.0.0.1:{localservers.free_port()}/0")
    with pytest.raises(RedisUnavailable, match="cannot reach"):
        await dead.call("PING")


def test_url_parsing():
    r = Resp.from_url("rediss://user:p%40ss@cache.local:6380/2")
    assert (r.host, r.port, r.db, r.username, r.password, r.tls) == (
        "cache.local",
        6380,
        2,
        "user",
        "p@ss",
        True,
    )
    with pytest.raises(ValueError, match="scheme"):
        Resp.from_url("unix:///tmp/redis.sock")


async def test_token_lookup_matches_the_registry(redis_url, redis_client):
    reg = Registry(redis_client)
    sessions = await running_session(reg, "resp-lookup", n=2)
    r = Resp.from_url(redis_url)
    store = SessionStore(r)
    try:
        for s in sessions:
            opened = await store.open(s.token)
            known = await reg.session_by_token(s.token)
            assert (opened.session_id, opened.attempt, opened.state, opened.task_id) == (
                known.session_id,
                known.attempt,
                known.state,
                known.task_id,
            )
            assert opened.seq is None  # a lookup that is not for a model call numbers nothing
            numbered = await store.open(s.token, number=True)
            assert numbered.session_id == opened.session_id and numbered.seq == 0
            assert (await store.open(s.token, number=True)).seq == 1
        assert await store.open("ps_not_a_token") is None
        assert await store.open("ps_not_a_token", number=True) is None
        # a token whose session hash is gone (expired apart): no state, so no call and no
        # number taken, rather than a lookup that fails to parse
        await redis_client.delete(S.key_session(sessions[0].session_id))
        gone = await store.open(sessions[0].token, number=True)
        assert (gone.state, gone.attempt, gone.task_id, gone.seq) == ("", 0, "", None)
        assert await SessionResolver(store)(sessions[0].token, True) is None
    finally:
        await r.aclose()
