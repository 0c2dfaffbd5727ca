"""What bounds the proxy's HTTP server (``proxy.io.native``) against a client that holds
connections open or frames requests badly: its time limits, its connection caps, and the
RFC 9112 checks of a request head that the parser (llhttp) leaves to its caller.

Every connection costs a file descriptor, and a model call one more (its engine
connection): past the open-files limit nothing is accepted, not even ``/healthz``. So the
connections are capped, in total (by default half of what the open-files limit leaves
after a reserve for the proxy's own files) and per client address; a connection past a
cap is read only to answer an operator's probe (``GET /healthz``, ``/metrics``), anything
else gets a 503 and the connection is closed. Those connections have ``overflow`` slots of
their own; the oldest is closed to make room for the next. Every refusal is counted in
``/metrics`` and logged (at most once per ``LOG_EVERY_S`` per kind, with the count since).
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass

import msgspec

from proxy import metrics

log = logging.getLogger("polar.proxy")

FD_RESERVE = 256  # the proxy's own files: NATS, Redis, logs, the model's files, slack
MAX_DERIVED_CONNECTIONS = 65_536  # the derived cap's ceiling (memory, not files, then)
MAX_OVERFLOW = 64  # connections past a cap, held to answer a probe or a 503
LOG_EVERY_S = 10.0
_NOFILE_CEILING = 1 << 20  # Linux's default fs.nr_open


class HttpLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The HTTP server's bounds (``services.proxy.config.http_server``)."""

    # a new connection's first request head, and every later one from its first byte, must
    # be complete within this; else the connection is closed
    head_timeout_seconds: float = 30.0
    # a kept-alive connection with no request under way is closed after this
    idle_timeout_seconds: float = 300.0
    # a request body must arrive within this (from the head's end, or from the
    # 100 Continue), extended by one second per `body_min_bytes_per_second` bytes that
    # came: else a 408 and the connection is closed
    body_timeout_seconds: float = 30.0
    body_min_bytes_per_second: float = 1024.0  # the rate that extends body_timeout_seconds
    # open connections at once; 0: derived from the open-files limit (see connection_caps)
    max_connections: int = 0
    # open connections from one client address at once (a node's harnesses share its
    # address, and the bridged sandboxes of a node on the proxy's host are all 127.0.0.1);
    # 0: no per-client cap
    max_connections_per_client: int = 512

    def __post_init__(self) -> None:
        for name in ("head_timeout_seconds", "idle_timeout_seconds", "body_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"http_server.{name} must be positive")
        if self.body_min_bytes_per_second <= 0:
            raise ValueError("http_server.body_min_bytes_per_second must be positive")
        if self.max_connections < 0 or self.max_connections_per_client < 0:
            raise ValueError("http_server connection caps must be 0 (derived / none) or more")

    @property
    def sweep_every(self) -> float:
        """How often the server checks its connections' deadlines."""
        timeouts = (self.head_timeout_seconds, self.idle_timeout_seconds, self.body_timeout_seconds)
        return min(1.0, *(t / 4 for t in timeouts))


@dataclass(frozen=True, slots=True)
class Caps:
    total: int  # admitted connections at once
    per_client: int  # admitted connections of one address at once; 0: none
    overflow: int  # connections past a cap, held to answer a probe or a 503


def open_files_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _NOFILE_CEILING if soft == resource.RLIM_INFINITY else soft


def raise_open_files_limit() -> int:
    """The soft open-files limit raised to the hard one (as Go's runtime does: the
    proxy uses epoll, never select), up to 2^20; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _NOFILE_CEILING if hard == resource.RLIM_INFINITY else min(hard, _NOFILE_CEILING)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, want, exc)
    return open_files_limit()


def connection_caps(limits: HttpLimits, open_files: int) -> Caps:
    """The caps under ``open_files`` descriptors: ``max_connections`` when set, else half
    of what ``FD_RESERVE`` leaves (each admitted connection may hold an engine
    connection too), at least 16, at most ``MAX_DERIVED_CONNECTIONS``."""
    spare = max(0, open_files - FD_RESERVE)
    total = limits.max_connections or min(MAX_DERIVED_CONNECTIONS, max(16, spare // 2))
    overflow = max(4, min(MAX_OVERFLOW, spare // 8))
    return Caps(total, limits.max_connections_per_client, overflow)


class Admission:
    """Who is admitted: the open connections per client address, against ``caps``."""

    def __init__(self, caps: Caps) -> None:
        self.caps = caps
        self.admitted = 0
        self.per_client: dict[str, int] = {}
        self._log = ThrottledLog()

    def admit(self, client: str) -> str | None:
        """None: admitted (``release`` it once closed); else which cap it is past."""
        n = self.per_client.get(client, 0)
        if self.admitted >= self.caps.total:
            reason = "total"
        elif self.caps.per_client and n >= self.caps.per_client:
            reason = "per_client"
        else:
            self.admitted += 1
            self.per_client[client] = n + 1
            return None
        metrics.CONNECTIONS_OVER_CAP.labels(reason).inc()
        cap = self.caps.total if reason == "total" else self.caps.per_client
        self._log.warn(
            reason,
            "connections past the %s cap (%d; %d open, %d from %s): 503 unless a probe",
            reason.replace("_", "-"),
            cap,
            self.admitted,
            n,
            client or "?",
        )
        return reason

    def release(self, client: str) -> None:
        self.admitted -= 1
        n = self.per_client[client] - 1
        if n:
            self.per_client[client] = n
        else:
            del self.per_client[client]


class ThrottledLog:
    """A warning per kind at most once per ``LOG_EVERY_S``, with how many were not
    logged since: a flood of refusals is seen in the log without filling it."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -LOG_EVERY_S) < LOG_EVERY_S:
            self._quiet[kind] = self._quiet.get(kind, 0) + 1
            return
        self._last[kind] = now
        quiet = self._quiet.pop(kind, 0)
        log.warning(
            message + (f" (+{quiet} more since the last such line)" if quiet else ""), *args
        )


def head_refusal(version: str, headers: dict[str, str], hosts: int) -> tuple[int, str] | None:
    """What RFC 9112 refuses in a request head that llhttp parsed: (status, reason), or
    None. An HTTP version other than 1.0 and 1.1 (2.0, 0.9's bare request line) is a 505;
    an HTTP/1.1 request without exactly one Host (§3.2), a Transfer-Encoding in HTTP/1.0
    (§6.1) or chunked twice is a 400; a transfer coding other than chunked is a 501
    (§6.1: the body cannot be read, so neither can what follows it)."""
    if version not in ("1.1", "1.0"):
        return 505, f"HTTP version {version} is not supported: use HTTP/1.1"
    if hosts > 1 or (version == "1.1" and hosts == 0):
        return 400, "an HTTP/1.1 request needs exactly one Host header"
    te = headers.get("transfer-encoding")
    if te is None:
        return None
    if version == "1.0":
        return 400, "Transfer-Encoding in an HTTP/1.0 request"
    codings = [c.strip().lower() for c in te.split(",")]
    unknown = [c for c in codings if c != "chunked"]
    if unknown:
        return 501, f"transfer coding {unknown[0]!r} is not implemented (only chunked)"
    if len(codings) > 1:
        return 400, "chunked applied more than once"
    return None
