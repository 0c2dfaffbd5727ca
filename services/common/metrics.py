"""Prometheus metrics shared by every service (one registry per process)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

MESSAGES = Counter(
    "polar_messages_total", "Bus messages handled, by consumer and result", ["consumer", "result"]
)
HANDLER_SECONDS = Histogram(
    "polar_handler_seconds",
    "Time to handle one bus message",
    ["consumer"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120, 600),
)
INFLIGHT = Gauge("polar_inflight_messages", "Messages being handled", ["consumer"])
TRANSITIONS = Counter(
    "polar_session_transitions_total", "Registry state transitions", ["to_state", "result"]
)
SERVICE_UP = Gauge(
    "polar_service_up", "1 while the service's dependencies are connected", ["service"]
)


def render() -> tuple[bytes, str]:
    return generate_latest(), CONTENT_TYPE_LATEST
