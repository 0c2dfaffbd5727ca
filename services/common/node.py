"""What the pool and the executor of one node share: session paths, harness context, and
observability (per-stage metrics, heartbeats read by ``polar status``)."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from schemas import NodeHeartbeat, Session, SessionState, TaskRequest, encode
from schemas import subjects as S
from services.executor.harnesses.base import HarnessContext


@dataclass(frozen=True)
class SessionPaths:
    """Node-side directories of one session."""

    sessions_dir: Path  # runtimes keep their session directories under here
    logs: Path  # prepare logs, harness stdout/stderr, collected harness logs

    @classmethod
    def of(cls, work_dir: str | Path, session_id: str) -> SessionPaths:
        root = Path(work_dir).resolve()
        return cls(sessions_dir=root / "sessions", logs=root / "logs" / session_id)


def harness_context(
    session: Session, task: TaskRequest, runtime, proxy_url: str, paths: SessionPaths
) -> HarnessContext:
    home = runtime.home
    return HarnessContext(
        session_id=session.session_id,
        task_id=session.task_id,
        attempt=session.attempt,
        instruction=task.instruction,
        token=session.token,
        proxy_url=runtime.proxy_url or proxy_url,  # a sandbox may reach it through a bridge
        agent=task.agent,
        workdir=runtime.workdir,
        home=home,
        log_dir=posixpath.join(home, ".polar", "logs"),
        artifact_dir=posixpath.join(home, ".polar", "artifacts"),
        task_env=dict(task.runtime.env),
    )


def node_runtime(
    config,
    spec,
    session_id: str,
    runtime_id: str | None = None,
    role: str = "main",
    *,
    harness: str | None = None,
):
    """A runtime of this node: a new one (``runtime_id`` None) or one that exists already
    (prepared by the pool, or left by a process that died). ``harness``: the task's, which
    decides what ``sandbox: auto`` means (every caller passes it: the same session gets
    the same sandbox from the pool, the executor and the evaluator)."""
    from services.runtimes.factory import adopt_runtime, create_runtime, with_default_sandbox

    spec = with_default_sandbox(spec, harness)
    kw = dict(
        base_dir=SessionPaths.of(config.work_dir, session_id).sessions_dir,
        proxy_url=config.proxy_url,
        docker_host=config.docker_host,
    )
    if runtime_id is None:
        return create_runtime(spec, session_id, role=role, **kw)
    return adopt_runtime(spec, session_id, runtime_id, **kw)


# -- observability: stage metrics and heartbeats --------------------------------------
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
