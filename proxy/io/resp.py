"""A small pipelined Redis client for the proxy's per-call session state.

Each model call does two Redis commands (one script finds the session, reads its TITO
states and numbers the call; one stores the new state). Through redis-py's pool each
cost ~3x the CPU of the round trip itself, which made Redis the largest share of the
proxy's per-call cost. This
client keeps one connection, writes commands as they come (concurrent calls share
round trips) and matches replies in order with hiredis' C parser.

``start`` / ``start_script`` write a command at once and return its reply to await
later, so a round trip can run while the caller does other work (the proxy numbers a
call while the engine answers it, and stores its state while JetStream acks its record).

Errors: a Redis error reply raises ``RedisReplyError``; a lost or refused connection
raises ``RedisUnavailable`` for every command in flight, and the next command
reconnects.

Sentinel (``redis+sentinel://``, ``services/common/endpoints.py``): each (re)connect asks
the sentinels for the master's address and checks ``ROLE`` there; a ``READONLY`` reply
(the primary was demoted under us) drops the connection, so the next command finds the
new primary. The fast path is unchanged: one connection, pipelined.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import ssl
from collections.abc import Awaitable, Coroutine
from typing import Any

import hiredis

from proxy.io.spin import POLL
from services.common.coalesce import Coalesced
from services.common.endpoints import EndpointError, RedisEndpoint, parse_redis
from services.common.oneconn import OneConnection

CONNECT_TIMEOUT_S = 5.0


class RedisUnavailable(ConnectionError):
    pass


class RedisReplyError(RuntimeError):
    pass


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None
        self.loop = asyncio.get_running_loop()  # once: per call it costs a getpid() on 3.11

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.out = Coalesced(transport, self.loop)  # the calls' commands, per loop turn

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            future = self.waiting.popleft()
            if future.done():
                continue
            if isinstance(reply, hiredis.ReplyError):
                if str(reply).startswith("READONLY") and self.transport is not None:
                    self.transport.close()  # a demoted primary: find the new one
                future.set_exception(RedisReplyError(str(reply)))
            else:
                future.set_result(reply)

    def connection_lost(self, exc) -> None:
        self.lost = RedisUnavailable(f"redis connection lost: {exc or 'closed'}")
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(self.lost)

    def send(self, payload: bytes) -> asyncio.Future:
        future = self.loop.create_future()
        POLL.watch(future)
        self.waiting.append(future)
        self.out.write(payload)
        return future


class Resp:
    """``await client.call("INCR", key)``; ``await client.script(sha_source, keys, args)``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        tls: bool = False,
        sentinel: RedisEndpoint | None = None,
    ) -> None:
        self.host, self.port, self.db = host, port, db
        self.username, self.password, self.tls = username, password, tls
        self.sentinel = sentinel  # set: host/port are looked up at each connect
        self._conn: OneConnection[_Protocol] = OneConnection(self._open)

    @classmethod
    def from_url(cls, url: str) -> Resp:
        try:
            ep = parse_redis(url)
        except EndpointError as exc:
            raise ValueError(str(exc)) from None
        return cls(
            ep.host,
            ep.port,
            db=ep.db,
            username=ep.username,
            password=ep.password,
            tls=ep.tls,
            sentinel=ep if ep.via_sentinel else None,
        )

    async def call(self, *args: Any) -> Any:
        proto = self._conn.live or await self._conn.get()
        return await proto.send(hiredis.pack_command(args))

    def start(self, *args: Any) -> Awaitable[Any]:
        """Send the command now (when connected; else once connected) and return its
        reply to await. Await it on every path: its failure is raised there."""
        proto = self._conn.live
        if proto is None:
            return asyncio.ensure_future(self.call(*args))
        return proto.send(hiredis.pack_command(args))

    async def script(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        return await self.start_script(script, keys, args)

    def start_script(self, script: Script, keys: list[str], args: list[Any]) -> Coroutine:
        """``start`` for a script (by its SHA1, loaded on the first NOSCRIPT): await the
        coroutine it returns, or close it."""
        sent = self.start("EVALSHA", script.sha, len(keys), *keys, *args)
        return self._script_reply(sent, script, keys, args)

    async def _script_reply(
        self, sent: Awaitable[Any], script: Script, keys: list[str], args: list[Any]
    ) -> Any:
        try:
            return await sent
        except RedisReplyError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.call("EVAL", script.source, len(keys), *keys, *args)

    async def _open(self) -> _Protocol:
        if self.sentinel is None:
            proto = await self._dial(self.host, self.port, self.tls)
            await self._hello(proto, self.username, self.password, self.db)
            return proto
        self.host, self.port = await self._master_address(self.sentinel)
        proto = await self._dial(self.host, self.port, self.tls)
        await self._hello(proto, self.username, self.password, self.db)
        role = await proto.send(hiredis.pack_command(("ROLE",)))
        if not role or role[0] != b"master":  # the sentinels have not caught up yet
            proto.transport.close()
            raise RedisUnavailable(f"redis at {self.host}:{self.port} is not the master yet")
        return proto

    async def _master_address(self, ep: RedisEndpoint) -> tuple[str, int]:
        """The master's address from the first sentinel that knows it."""
        errors = []
        for host, port in ep.sentinels:
            try:
                proto = await self._dial(host, port, ep.tls)
            except RedisUnavailable as exc:
                errors.append(str(exc))
                continue
            try:
                await self._hello(proto, ep.sentinel_username, ep.sentinel_password, 0)
                ask = ("SENTINEL", "get-master-addr-by-name", ep.master)
                reply = await asyncio.wait_for(
                    proto.send(hiredis.pack_command(ask)), CONNECT_TIMEOUT_S
                )
            except (RedisUnavailable, RedisReplyError, TimeoutError) as exc:
                errors.append(f"sentinel {host}:{port}: {exc}")
                continue
            finally:
                proto.transport.close()
            if reply:
                return reply[0].decode(), int(reply[1])
            errors.append(f"sentinel {host}:{port} knows no master {ep.master!r}")
        raise RedisUnavailable(f"no sentinel gave the master {ep.master!r}: {'; '.join(errors)}")

    async def _dial(self, host: str, port: int, tls: bool) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(
                    _Protocol, host, port, ssl=ssl.create_default_context() if tls else None
                ),
                CONNECT_TIMEOUT_S,
            )
        except (OSError, TimeoutError) as exc:
            raise RedisUnavailable(f"cannot reach redis at {host}:{port}: {exc}") from exc
        return proto

    @staticmethod
    async def _hello(proto: _Protocol, username: str | None, password: str | None, db: int) -> None:
        setup: list[tuple] = []
        if password is not None:
            setup.append(("AUTH", username, password) if username else ("AUTH", password))
        if db:
            setup.append(("SELECT", db))
        for command in setup:
            try:
                await proto.send(hiredis.pack_command(command))
            except RedisReplyError as exc:
                proto.transport.close()
                raise RedisUnavailable(f"redis refused {command[0]}: {exc}") from exc

    async def aclose(self) -> None:
        self._conn.close()


class Script:
    """A Lua script, run by its SHA1 (loaded on first NOSCRIPT)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
