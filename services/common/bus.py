"""NATS JetStream: connection, streams and consumers declared in code, the claim-check.

Streams and durable consumers are applied idempotently at every start with
``add_stream``/``update_stream`` and ``add_consumer`` (which creates or updates), never
through ``pull_subscribe(config=...)``, which ignores config for an existing durable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import nats
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import (
    BadRequestError,
    NotFoundError,
    ObjectNotFoundError,
    ServiceUnavailableError,
)
from nats.js.object_store import ObjectStore

from schemas import subjects as S
from services.common.endpoints import nats_servers
from services.common.jspub import JetStreamPublisher, PublishError
from services.common.redact import redact
from services.common.settings import OBJECT_STREAM, Retention

log = logging.getLogger(__name__)

CLAIM_HEADER = "Polar-Claim"  # the payload is in the object store under this name
CLAIM_THRESHOLD = 768 * 1024  # leave headroom under the default 1 MiB max_payload

# Age and size limits come from the retention policy (``declared``), not from here.
STREAMS: tuple[StreamConfig, ...] = (
    StreamConfig(
        name=S.STREAM_TASKS,
        subjects=[S.ALL_TASKS],
        storage=StorageType.FILE,
        duplicate_window=3600.0,
    ),
    StreamConfig(
        name=S.STREAM_SESSIONS,
        subjects=[S.ALL_SESSIONS],
        storage=StorageType.FILE,
        retention=RetentionPolicy.WORK_QUEUE,
        duplicate_window=3600.0,
    ),
    StreamConfig(
        name=S.STREAM_EVENTS,
        subjects=[S.ALL_EVENTS],
        storage=StorageType.FILE,
        duplicate_window=600.0,
    ),
    StreamConfig(
        name=S.STREAM_COMPLETIONS,
        subjects=[S.ALL_COMPLETIONS],
        storage=StorageType.FILE,
        duplicate_window=600.0,
    ),
    StreamConfig(
        name=S.STREAM_TRAJECTORIES,
        subjects=[S.ALL_TRAJECTORIES],
        storage=StorageType.FILE,
        duplicate_window=3 * 3600.0,
    ),
    StreamConfig(
        name=S.STREAM_REGRADES,
        subjects=[S.ALL_REGRADES],
        storage=StorageType.FILE,
        duplicate_window=3 * 3600.0,
    ),
    StreamConfig(
        name=S.STREAM_DLQ,
        subjects=[S.ALL_DEAD_LETTERS],
        storage=StorageType.FILE,
    ),
)


class CredentialsRefused(RuntimeError):
    """NATS refused the client's credentials (or wants some and none were given): no
    retry can help, so the client stops with this instead of retrying forever. (Not an
    OSError: nothing that retries an unreachable server retries this.)"""


class GaveUp(ConnectionError):
    """No server of the URL answered within the first connection's time limit."""


# what a client whose credentials are refused does about it (a `polar up` stack keeps its
# credentials across restarts; `polar credentials rotate` changes them)
REFUSED_HINT = (
    "connect with the stack's own: `-t topology.yaml` / `--state-dir` of the stack, or "
    "the URLs in its <state_dir>/polar.env (`polar credentials show` prints them)"
)


def is_auth_error(exc: BaseException) -> bool:
    """The server refused the client's credentials (nats-py raises a plain Error with
    the server's ``-ERR 'Authorization Violation'`` text on the first connect)."""
    return isinstance(exc, nats.errors.AuthorizationError) or (
        isinstance(exc, nats.errors.Error) and "authorization" in str(exc).lower()
    )


def refused(url: str, exc: BaseException) -> CredentialsRefused:
    servers = nats_servers(url)
    where, user = redact(", ".join(servers)), urlsplit(servers[0]).username
    if user:
        why = (
            f"refused the credentials for user {unquote(user)!r} ({exc}): the stack's "
            "credentials changed (`polar credentials rotate`) or this is not its URL;"
        )
    else:
        why = f"wants credentials and none were given ({exc}):"
    return CredentialsRefused(f"NATS at {where} {why} {REFUSED_HINT}")


async def connect(url: str, name: str, *, connect_timeout: float = 60.0) -> NATS:
    """Connect to any of the URL's servers (comma-separated: a cluster), retrying the
    first connection for up to ``connect_timeout`` seconds (then ``ConnectionError``),
    then reconnect forever, across the cluster's servers. Refused credentials on the
    first connection raise ``CredentialsRefused`` at once (nats-py would retry them
    forever)."""
    deadline = asyncio.get_running_loop().time() + connect_timeout
    nc = NATS()
    connecting = True

    async def on_error(exc: Exception) -> None:
        # nats-py awaits this inside its first-connect loop (which retries forever):
        # raising here ends that loop (and may come back here: pass it on as it is)
        if isinstance(exc, GaveUp | CredentialsRefused):
            raise exc
        if connecting and is_auth_error(exc):
            raise refused(url, exc)
        if connecting and asyncio.get_running_loop().time() > deadline:
            raise GaveUp(f"cannot reach NATS at {redact(url)}: {exc}")
        await _log_error(exc)

    try:
        await nc.connect(
            nats_servers(url),
            name=name,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=2,
            ping_interval=10,
            error_cb=on_error,
            disconnected_cb=_log_disconnect,
        )
    except BaseException:
        await _close_quietly(nc)
        raise
    connecting = False
    return nc


async def _close_quietly(nc: NATS) -> None:
    try:
        await nc.close()
    except Exception:  # noqa: BLE001 - a connection that never opened: nothing to close
        pass


async def _log_error(exc: Exception) -> None:
    log.warning("nats: %s", exc)


async def _log_disconnect() -> None:
    # Also fires on a deliberate close; a real outage shows in error_cb and health checks.
    log.info("nats: disconnected")


def replicated(streams: tuple[StreamConfig, ...], replicas: int) -> tuple[StreamConfig, ...]:
    """The streams with ``replicas`` copies each (R3 on a 3-node JetStream cluster: any
    one server can be lost without losing a message or stopping the stream)."""
    if not 1 <= replicas <= 5:
        raise ValueError(f"nats_replicas must be 1..5 (JetStream's limit), not {replicas}")
    return tuple(dataclasses.replace(cfg, num_replicas=replicas) for cfg in streams)


def declared(streams: tuple[StreamConfig, ...], retention: Retention) -> tuple[StreamConfig, ...]:
    """The streams with the retention policy's age and size limits."""
    out = []
    for cfg in streams:
        limits = retention.limits(cfg.name or "")
        if limits is not None:
            cfg = dataclasses.replace(
                cfg, max_age=limits.max_age_seconds, max_bytes=limits.max_bytes
            )
        out.append(cfg)
    return tuple(out)


async def ensure_streams(
    js: JetStreamContext,
    streams: tuple[StreamConfig, ...] = STREAMS,
    *,
    replicas: int = 1,
    retention: Retention = Retention(),
) -> None:
    for cfg in replicated(declared(streams, retention), replicas):
        try:
            await js.add_stream(cfg)
        except BadRequestError:  # exists with another config: bring it up to date
            await js.update_stream(cfg)
    blobs = retention.limits(OBJECT_STREAM)
    try:
        await js.object_store(S.OBJECT_STORE)
    except (NotFoundError, BadRequestError):
        # (nats-py 2.16 overwrites config.bucket with the bucket argument: pass both)
        config = ObjectStoreConfig(
            replicas=replicas, ttl=blobs.max_age_seconds or None, max_bytes=blobs.max_bytes
        )
        await js.create_object_store(S.OBJECT_STORE, config=config)
        return
    # an older store, or another policy: bring its copies and limits up to date
    info = await js.stream_info(OBJECT_STREAM)
    wanted = dataclasses.replace(
        info.config,
        num_replicas=replicas,
        max_age=blobs.max_age_seconds,
        max_bytes=blobs.max_bytes,
    )
    if wanted != info.config:
        await js.update_stream(wanted)


# How long a starting service waits for JetStream to take its stream declarations: a
# cluster that is still electing its meta leader answers 503 or nothing, and on a loaded
# machine an R3 stream's creation outlasts the API's 10 s timeout (a scheduler in the
# multi-host test exited at start that way); a service that exits then only restarts.
JETSTREAM_READY_WAIT_S = 180.0
NOT_READY = (NatsTimeoutError, ServiceUnavailableError, NoRespondersError)


def _not_ready_reason(exc: Exception) -> str:
    if isinstance(exc, ServiceUnavailableError):  # nats-py's text is "code=None ..." here
        return "503: JetStream is starting, electing its leader or not enabled"
    if isinstance(exc, NoRespondersError):
        return "no responders: JetStream is not enabled on this server (yet)"
    return "the JetStream API timed out"


async def declare_when_ready(
    js: JetStreamContext,
    *,
    replicas: int = 1,
    retention: Retention = Retention(),
    wait_s: float = JETSTREAM_READY_WAIT_S,
    on_wait: Callable[[Exception], None] | None = None,
) -> None:
    """``ensure_streams``, again (idempotent) while JetStream is not ready, up to
    ``wait_s``; ``on_wait(exc)`` is told of each wait (tests wait on it)."""
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + wait_s, 0.25
    while True:
        try:
            await ensure_streams(js, replicas=replicas, retention=retention)
            return
        except NOT_READY as exc:
            if loop.time() + pause > deadline:
                raise
            why = _not_ready_reason(exc)
            log.warning("JetStream is not ready (%s): declaring the streams again", why)
            if on_wait is not None:
                on_wait(exc)
            await asyncio.sleep(pause)
            pause = min(2 * pause, 5.0)


def work_consumer(
    durable: str,
    subject: str,
    *,
    ack_wait: float = 30.0,
    max_deliver: int = 5,
    max_ack_pending: int = 1000,
) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=durable,
        filter_subject=subject,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait,
        max_deliver=max_deliver,
        max_ack_pending=max_ack_pending,
    )


def evaluation_queue(node: str, *, ack_wait: float = 30.0, max_deliver: int = 10) -> ConsumerConfig:
    """The durable of the sessions evaluated in a runtime left on ``node``: its
    evaluators take from it; its executor declares it at start, so a node without an
    evaluator still has a queue whose untaken work another evaluator sees (and takes
    over: services/evaluator/orphans.py). The defaults are EvaluatorConfig's."""
    return work_consumer(
        S.consumer_evaluator_on(node),
        S.sessions_built_on(node),
        ack_wait=ack_wait,
        max_deliver=max_deliver,
    )


# A JetStream API request can time out on a stalled server (a loaded disk); creating a
# durable with the same config again is idempotent, so it is asked again before failing.
CONSUMER_CREATE_TRIES = 3


async def ensure_consumer(js: JetStreamContext, stream: str, cfg: ConsumerConfig) -> None:
    for attempt in range(1, CONSUMER_CREATE_TRIES + 1):
        try:
            await js.add_consumer(stream, cfg)
            return
        except NatsTimeoutError:
            if attempt == CONSUMER_CREATE_TRIES:
                raise
            log.warning(
                "creating consumer %s on %s timed out: asking again", cfg.durable_name, stream
            )
            await asyncio.sleep(0.5 * attempt)


@dataclass(frozen=True)
class Bus:
    nc: NATS
    js: JetStreamContext
    # ``publish_retrying``: tries, and the first pause (doubling): ~8 s in all
    publish_tries: int = 6
    publish_backoff: float = 0.25
    # ``send``'s publisher (``open`` makes one for the bus's URL): None sends through
    # ``publish``.
    lean: JetStreamPublisher | None = dataclasses.field(default=None, repr=False)
    _stores: dict[str, ObjectStore] = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    async def open(
        cls,
        url: str,
        name: str,
        *,
        declare: bool = True,
        replicas: int = 1,
        retention: Retention = Retention(),
    ) -> Bus:
        nc = await connect(url, name)
        js = nc.jetstream(timeout=10)
        if declare:
            await declare_when_ready(js, replicas=replicas, retention=retention)
        bus = cls(nc, js)
        lean = JetStreamPublisher(
            url, name=f"{name}-send", fallback=bus.publish, fallback_above=CLAIM_THRESHOLD
        )
        return dataclasses.replace(bus, lean=lean)

    async def blobs(self) -> ObjectStore:
        """The object store, one handle per bus: ``js.object_store`` asks the server for
        the store's stream info on every call (a round trip per trajectory)."""
        store = self._stores.get(S.OBJECT_STORE)
        if store is None:
            store = self._stores[S.OBJECT_STORE] = await self.js.object_store(S.OBJECT_STORE)
        return store

    async def close(self) -> None:
        if self.lean is not None:
            await self.lean.aclose()
        if not self.nc.is_closed:
            await self.nc.drain()

    async def publish(
        self,
        subject: str,
        payload: bytes,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        """JetStream publish with an optional dedupe id; large payloads go by claim-check."""
        hdrs = dict(headers or {})
        if msg_id:
            hdrs["Nats-Msg-Id"] = msg_id
        if len(payload) > CLAIM_THRESHOLD:
            name = f"{subject}/{msg_id or uuid.uuid4().hex}"
            await (await self.blobs()).put(name, payload)
            hdrs[CLAIM_HEADER] = name
            payload = b""
        return await self.js.publish(subject, payload, headers=hdrs or None)

    async def send(self, subject: str, payload: bytes, *, msg_id: str | None = None) -> None:
        """``publish`` without headers of its own and without an answer (stored or
        deduplicated: the same to every caller of this), for the per-session hot paths:
        through the lean publisher (``jspub``: HPUB and the ack on a plain connection of
        its own, ~40 µs of CPU against nats-py's ~170 µs), which hands claim-checked
        payloads and servers it cannot speak to plainly (TLS, credentials) to ``publish``.
        A lean publish that fails (the server unreachable, the connection lost before the
        ack) is made again through ``publish``: nats-py's client waits out a reconnect,
        where the lean one fails at once (a hand-off during a NATS restart then used up
        ``publish_retrying``'s tries in seconds and left its session unannounced), and
        the dedupe id makes a second copy harmless. Raises as ``publish`` does."""
        if self.lean is None:
            await self.publish(subject, payload, msg_id=msg_id)
            return
        try:
            await self.lean.publish(subject, payload, msg_id=msg_id)
        except PublishError as exc:
            log.info("lean publish to %s failed (%s): through nats-py", subject, exc)
            await self.publish(subject, payload, msg_id=msg_id)

    async def publish_retrying(self, subject: str, payload: bytes, *, msg_id: str):
        """``send``, tried again (``publish_tries``, backoff doubling) while the server
        is unreachable or restarting. The dedupe id makes a retry of a publish that was
        stored after all harmless. For hand-offs that nothing else would redo (a
        session's READY work, its retry's INIT work, its finish event)."""
        tries, delay = self.publish_tries, self.publish_backoff
        for attempt in range(1, tries + 1):
            try:
                return await self.send(subject, payload, msg_id=msg_id)
            except (nats.errors.Error, TimeoutError, ConnectionError) as exc:
                if attempt == tries:
                    raise
                log.warning("publish to %s failed (%s); try %d of %d", subject, exc, attempt, tries)
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    async def payload(self, msg) -> bytes:
        """The message's payload, fetched from the object store when it was claim-checked."""
        name = (msg.headers or {}).get(CLAIM_HEADER)
        if not name:
            return msg.data
        store = await self.blobs()
        try:
            return (await store.get(name)).data
        except ObjectNotFoundError as exc:
            raise LookupError(f"claim-checked payload {name!r} is gone") from exc
