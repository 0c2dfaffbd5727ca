"""The proxy's Prometheus metrics (per protocol).

The per-call ones are tallies (``services.common.tally``): counted on the event loop
without prometheus_client's lock, read by the registry when scraped."""

from __future__ import annotations

import time

from prometheus_client import Gauge

from services.common.tally import CounterFamily, HistogramFamily

CALLS = CounterFamily(
    "polar_proxy_calls_total", "Model calls by protocol and result", ["protocol", "result"]
)
LATENCY = HistogramFamily(
    "polar_proxy_call_seconds",
    "Harness-visible call time (received -> captured)",
    ["protocol"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
OVERHEAD = HistogramFamily(
    "polar_proxy_overhead_seconds",
    "Call time not spent in the engine",
    ["protocol"],
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
)
TOKENS = CounterFamily("polar_proxy_tokens_total", "Tokens by direction", ["protocol", "direction"])
CAPTURE_FAILURES = CounterFamily(
    "polar_proxy_capture_failures_total", "Calls not captured", ["protocol"]
)
STATE_WRITE_FAILURES = CounterFamily(
    "polar_proxy_state_write_failures_total",
    "Calls captured and answered whose TITO state Redis did not store (the next call "
    "re-renders its prompt instead of extending it)",
    ["protocol"],
)
# MoE expert routing (proxy/routing.py): calls that carried it, by what the record stores
ROUTING = CounterFamily(
    "polar_proxy_routing_calls_total",
    "Token-mode calls whose engine returned expert routing, by how they stored it (delta: "
    "rows past the base's; full: every row; missing: asked, none came back)",
    ["result"],
)
ROUTING_ROWS = CounterFamily(
    "polar_proxy_routing_rows_total",
    "Routing rows (positions) the engine returned and the records stored",
    ["kind"],
)
ROUTING_NOT_STORED = CounterFamily(
    "polar_proxy_routing_not_stored_total",
    "Calls answered and captured without their routing: the object store refused the rows",
    [],
)
DRIFT = CounterFamily(
    "polar_proxy_prompt_breaks_total",
    "Prompts that did not extend the previous call, by reason",
    ["protocol", "reason"],
)
SIDE_CALLS = CounterFamily(
    "polar_proxy_side_calls_total", "Calls outside the main loop", ["protocol", "kind"]
)
PAUSED = Gauge("polar_proxy_paused", "1 while paused for a weight update")
INFLIGHT = Gauge("polar_proxy_inflight_calls", "Model calls admitted and not yet answered")
# the HTTP server's own refusals (proxy/io/native.py, proxy/io/limits.py)
CONNECTIONS_OVER_CAP = CounterFamily(
    "polar_proxy_connections_over_cap_total",
    "Connections past a connection cap (total or per client): answered 503, or only a probe",
    ["cap"],
)
HTTP_REFUSED = CounterFamily(
    "polar_proxy_http_refused_total",
    "Requests the HTTP server refused before the app saw them, by status (400 malformed "
    "framing or no Host, 408 body too slow, 431 head too large, 501 unknown transfer "
    "coding, 503 past a connection cap, 505 HTTP version)",
    ["status"],
)
OPEN_CONNECTIONS = Gauge("polar_proxy_open_connections", "Client connections open now")
CONNECTION_CAP = Gauge("polar_proxy_connection_cap", "Client connections admitted at most")


class _PerProtocol:
    """The labelled series every successful call touches, looked up once per protocol."""

    __slots__ = ("ok", "latency", "overhead", "tokens_in", "tokens_out")

    def __init__(self, protocol: str) -> None:
        self.ok = CALLS.labels(protocol, "ok")
        self.latency = LATENCY.labels(protocol)
        self.overhead = OVERHEAD.labels(protocol)
        self.tokens_in = TOKENS.labels(protocol, "in")
        self.tokens_out = TOKENS.labels(protocol, "out")


_series: dict[str, _PerProtocol] = {}


def observe_call(protocol: str, ctx, gen, plan) -> None:
    now = time.time()
    m = _series.get(protocol)
    if m is None:
        m = _series[protocol] = _PerProtocol(protocol)
    m.ok.inc()
    m.latency.observe(now - ctx.received)
    if gen.upstream_end:
        m.overhead.observe(max(0.0, (now - ctx.received) - (gen.upstream_end - gen.upstream_start)))
    m.tokens_in.inc(len(gen.prompt_ids))
    m.tokens_out.inc(len(gen.output_ids))
    if plan.extends is False:
        DRIFT.labels(protocol, plan.drift_reason or "unknown").inc()
    if ctx.side_call:
        SIDE_CALLS.labels(protocol, ctx.side_call).inc()
