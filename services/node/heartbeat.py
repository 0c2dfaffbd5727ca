"""A node's observability: per-stage metrics and the heartbeats ``polar status`` reads."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from schemas import NodeHeartbeat, SessionState, encode
from schemas import subjects as S

_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
STAGE_SESSIONS = Gauge(
    "polar_node_stage_sessions",
    "Sessions of a node per stage (QUEUED: init work the pool holds, not yet admitted)",
    ["node", "stage"],
)
STAGE_CAPACITY = Gauge("polar_node_stage_capacity", "A node's bound per stage", ["node", "stage"])
STAGE_WAIT = Histogram(
    "polar_node_stage_wait_seconds",
    "Time queued before a stage began (init: init work published -> INITIALIZING; "
    "run: READY -> RUNNING, i.e. time in the READY buffer)",
    ["node", "stage"],
    buckets=_SECONDS,
)
STAGE_SECONDS = Histogram(
    "polar_node_stage_seconds",
    "Time a stage took (init: INITIALIZING -> handed over READY; harness: the agent's run; "
    "run: RUNNING -> finished, artifacts and runtime stop included)",
    ["node", "stage"],
    buckets=_SECONDS,
)
STAGE_RESULTS = Counter(
    "polar_node_stage_results_total", "Stages ended, by result", ["node", "stage", "result"]
)


def heartbeat_key(node: str, service: str) -> str:
    """Field of the ``polar:nodes`` hash: one row per service of a node."""
    return f"{node}/{service}"


async def node_stages(registry, node: str, stages: dict[str, SessionState]) -> dict[str, int]:
    """{"INIT": n, ...}: how many of the node's sessions are in each named stage."""
    counts = await registry.node_stage_counts(node, stages.values())
    return {name: counts[st.value] for name, st in stages.items()}


async def send_heartbeat(bus, registry, beat: NodeHeartbeat) -> None:
    """Record the beat where ``polar status`` reads it, announce it, mirror it in gauges."""
    payload = encode(beat)
    await registry.redis.hset(S.KEY_NODES, heartbeat_key(beat.node, beat.service), payload)
    await bus.nc.publish(S.NODE_HEARTBEAT, payload)
    for stage, n in beat.stages.items():
        STAGE_SESSIONS.labels(beat.node, stage).set(n)
    for stage, n in beat.capacity.items():
        STAGE_CAPACITY.labels(beat.node, stage).set(n)
