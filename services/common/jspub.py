"""A lean JetStream publisher for hot paths: publish, wait for the stream's ack.

nats-py's ``js.publish`` costs ~170 µs of CPU per message here (request machinery,
``wait_for``, JSON ack into a dataclass), which was the largest single item of the
proxy's per-call work after the HTTP server itself. This client keeps one plain
connection of its own, writes ``HPUB`` with a reply subject under one wildcard inbox
and matches acks to futures by that subject: ~40 µs.

The proxy publishes its records with it; every service's ``Bus.send`` (state-change
events, work hand-offs, built and scored trajectories) too.

What it does not do, it hands to ``fallback`` (``Bus.publish``): payloads over the
claim-check threshold (they go through the object store), and servers it cannot talk to
plainly (TLS, nkeys/JWT credentials). A lost connection fails every publish in flight
(``PublishError``: the caller decides, e.g. the proxy answers 503 and the harness
retries) and the next publish reconnects.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any
from urllib.parse import unquote, urlsplit

import orjson

from services.common.coalesce import Coalesced
from services.common.deadlines import Deadlines
from services.common.oneconn import OneConnection

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
Fallback = Callable[..., Awaitable[object]]
Watch = Callable[[asyncio.Future], None]  # told of each ack awaited (the proxy's busy-poll)


class PublishError(ConnectionError):
    """The message was not (known to be) stored: no ack, a refusal, or no connection."""


class DuplicateMessage(PublishError):
    """The message id was stored before: this message was dropped (``new_only``)."""


class Unsupported(Exception):
    """The server needs something this client does not speak (TLS, credentials)."""


class _Protocol(asyncio.Protocol):
    def __init__(self, inbox: bytes) -> None:
        self.inbox = inbox  # b"_INBOX.<id>."
        self.buf = bytearray()
        self.acks: dict[bytes, asyncio.Future] = {}
        self.transport: asyncio.Transport | None = None
        # kept: asking for the running loop per publish costs a getpid() on Python 3.11
        self.loop = loop = asyncio.get_running_loop()
        self.greeted: asyncio.Future = loop.create_future()  # the server's first INFO
        self.ready: asyncio.Future = loop.create_future()  # PONG to our CONNECT + PING
        self.lost: Exception | None = None
        self.due = Deadlines(loop)  # the acks' (one timer for them all)

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.out = Coalesced(transport, self.loop)  # the publishes, per loop turn

    def connection_lost(self, exc) -> None:
        self.lost = PublishError(f"NATS connection lost: {exc or 'closed'}")
        for waiting in (self.greeted, self.ready):
            if not waiting.done():
                waiting.set_exception(self.lost)
                waiting.exception()  # seen: whoever awaits it gets it, nobody else is told
        for future in self.acks.values():
            if not future.done():
                future.set_exception(self.lost)
        self.acks.clear()
        self.due.clear()  # failed just now, every one

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        try:
            while True:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                op = bytes(buf[pos : pos + 4]).upper()
                if op in (b"MSG ", b"HMSG"):
                    used = self._message(buf, pos, end)
                    if used < 0:
                        break  # its payload is not all here yet
                    pos = used
                    continue
                line = bytes(buf[pos:end])
                pos = end + 2
                self._control(line)
        finally:
            del buf[:pos]

    def _message(self, buf: bytearray, pos: int, end: int) -> int:
        parts = bytes(buf[pos:end]).split()
        headered = parts[0].upper() == b"HMSG"
        size = int(parts[-1])
        start, stop = end + 2, end + 2 + size
        if len(buf) < stop + 2:
            return -1
        subject = parts[1]
        future = self.acks.pop(subject, None)
        if future is not None and not future.done():
            hdr_len = int(parts[-2]) if headered else 0
            head, body = bytes(buf[start : start + hdr_len]), bytes(buf[start + hdr_len : stop])
            future.set_result((head, body))
        return stop + 2

    def _control(self, line: bytes) -> None:
        op = line[:4].upper()
        if op == b"PING":
            self.transport.write(b"PONG\r\n")
        elif op == b"PONG":
            if not self.ready.done():
                self.ready.set_result(None)
        elif op == b"INFO":
            if not self.greeted.done():
                self.greeted.set_result(orjson.loads(line[5:]))
        elif op == b"-ERR":
            err = PublishError(f"NATS error: {line[5:].decode(errors='replace').strip()}")
            if not self.ready.done():
                self.ready.set_exception(err)
            else:
                log.warning("%s", err)
        # +OK: verbose is off, so only ever an echo of the CONNECT


class JetStreamPublisher:
    """``await publisher.publish(subject, payload, msg_id=...)`` -> the stream sequence."""

    def __init__(
        self,
        url: str,
        *,
        name: str,
        fallback: Fallback,
        fallback_above: int,
        ack_timeout: float = 10.0,
        watch: Watch | None = None,
    ) -> None:
        self.servers = [s.strip() for s in url.split(",") if s.strip()]
        self.name, self.fallback, self.fallback_above = name, fallback, fallback_above
        self.ack_timeout, self.watch = ack_timeout, watch
        self._conn: OneConnection[_Protocol] = OneConnection(self._open_any)
        self._next = itertools.count(1)
        self.unsupported: str | None = None  # why everything goes to the fallback

    async def publish(
        self, subject: str, payload: bytes, *, msg_id: str | None = None, new_only: bool = False
    ) -> int:
        """Publish and wait for the ack: the stream sequence. ``new_only``: a message
        whose id was stored before is an error (``DuplicateMessage``), not a success."""
        return await self.start(subject, payload, msg_id=msg_id, new_only=new_only)

    def start(
        self, subject: str, payload: bytes, *, msg_id: str | None = None, new_only: bool = False
    ) -> Coroutine[Any, Any, int]:
        """``publish``, written at once when connected (the caller does other work before
        awaiting the ack): await the coroutine returned, or close it."""
        proto = self._conn.live
        if proto is None or self.unsupported is not None or len(payload) > self.fallback_above:
            return self._publish_slow(subject, payload, msg_id, new_only)
        return self._send(proto, subject, payload, msg_id, new_only)

    async def _publish_slow(
        self, subject: str, payload: bytes, msg_id: str | None, new_only: bool
    ) -> int:
        if self.unsupported is not None or len(payload) > self.fallback_above:
            ack = await self.fallback(subject, payload, msg_id=msg_id)
            if new_only and getattr(ack, "duplicate", False):
                raise DuplicateMessage(_dropped(subject, msg_id, ack.seq))
            return int(getattr(ack, "seq", 0) or 0)
        try:
            proto = await self._conn.get()
        except Unsupported as exc:
            self.unsupported = str(exc)
            log.info("lean JetStream publisher off (%s): publishing through nats-py", exc)
            return await self._publish_slow(subject, payload, msg_id, new_only)
        return await self._send(proto, subject, payload, msg_id, new_only)

    def _send(
        self, proto: _Protocol, subject: str, payload: bytes, msg_id: str | None, new_only: bool
    ) -> Coroutine[Any, Any, int]:
        reply = proto.inbox + str(next(self._next)).encode()
        future = proto.loop.create_future()
        if self.watch is not None:
            self.watch(future)
        proto.acks[reply] = future
        headers = b"NATS/1.0\r\nNats-Msg-Id: " + msg_id.encode() + b"\r\n\r\n" if msg_id else b""
        if headers:
            proto.out.write(
                b"HPUB %s %s %d %d\r\n%s%s\r\n"
                % (subject.encode(), reply, len(headers), len(headers) + len(payload), headers,
                   payload)
            )  # fmt: skip
        else:
            proto.out.write(
                b"PUB %s %s %d\r\n%s\r\n" % (subject.encode(), reply, len(payload), payload)
            )
        proto.due.add(future, self.ack_timeout, partial(_no_ack, future))
        return _acked(subject, future, proto, reply, msg_id if new_only else None)

    async def _open_any(self) -> _Protocol:
        errors = []
        for server in self.servers:
            try:
                return await self._open(server)
            except (OSError, TimeoutError, PublishError) as exc:
                errors.append(f"{server}: {exc}")
        raise PublishError("cannot reach NATS: " + "; ".join(errors))

    async def _open(self, server: str) -> _Protocol:
        u = urlsplit(server if "://" in server else f"nats://{server}")
        if u.scheme not in ("nats", ""):
            raise Unsupported(f"{u.scheme}:// URL")
        loop = asyncio.get_running_loop()
        inbox = b"_INBOX.%s." % os.urandom(11).hex().encode()
        transport, proto = await asyncio.wait_for(
            loop.create_connection(
                lambda: _Protocol(inbox), u.hostname or "127.0.0.1", u.port or 4222
            ),
            CONNECT_TIMEOUT_S,
        )
        try:
            info = await asyncio.wait_for(proto.greeted, CONNECT_TIMEOUT_S)
            if info.get("tls_required") or info.get("nonce"):
                raise Unsupported("the server asks for TLS or signed credentials")
            opts = {
                "verbose": False,
                "pedantic": False,
                "headers": True,
                "no_responders": True,
                "lang": "python-polar",
                "version": "1",
                "protocol": 1,
                "name": self.name,
            }
            if u.username and u.password is not None:
                opts.update(user=unquote(u.username), **{"pass": unquote(u.password)})
            elif u.username:
                opts["auth_token"] = unquote(u.username)
            transport.write(b"CONNECT %s\r\nPING\r\n" % orjson.dumps(opts))
            transport.write(b"SUB %s* 1\r\n" % inbox)
            await asyncio.wait_for(proto.ready, CONNECT_TIMEOUT_S)
        except BaseException:
            transport.close()
            raise
        return proto

    async def aclose(self) -> None:
        self._conn.close()


async def _acked(subject: str, future, proto: _Protocol, reply: bytes, new_id: str | None) -> int:
    try:
        head, body = await future
    finally:
        proto.acks.pop(reply, None)
    return _pub_ack(subject, head, body, new_id)


def _no_ack(future: asyncio.Future) -> None:
    future.set_exception(PublishError("no JetStream ack in time"))


def _dropped(subject: str, msg_id: str | None, seq: int) -> str:
    return f"{subject}: message id {msg_id!r} already stored (seq {seq}): this one was dropped"


def _pub_ack(subject: str, head: bytes, body: bytes, new_id: str | None = None) -> int:
    """The stored sequence; ``new_id``: the message's id, which must not be stored before."""
    if head[:12] == b"NATS/1.0 503":
        raise PublishError(f"no JetStream stream takes {subject!r}")
    if not body:
        status = head.split(b"\r\n", 1)[0].decode(errors="replace")
        raise PublishError(f"unexpected reply to a JetStream publish: {status!r}")
    ack = orjson.loads(body)
    if "error" in ack:
        e = ack["error"]
        raise PublishError(f"JetStream refused the message: {e.get('description')} ({e})")
    if new_id is not None and ack.get("duplicate"):
        raise DuplicateMessage(_dropped(subject, new_id, ack["seq"]))
    return int(ack["seq"])
