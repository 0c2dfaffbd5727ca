"""Sessions ready for the evaluator, made as the pipeline makes them: a task in the
registry, sessions driven to EVALUATING, the unscored trajectory in the object store,
TrajectoryBuilt on the bus (used by the evaluator and client integration tests)."""

from __future__ import annotations

from nats.js.errors import NotFoundError

from schemas import (
    Artifacts,
    Outcome,
    SessionState,
    TaskRequest,
    Trace,
    Trajectory,
    TrajectoryBuilt,
    decode,
    encode,
)
from schemas import subjects as S
from services.builder.logic import built_msg_id

TO_EVALUATING = ("INITIALIZING", "READY", "RUNNING", "POSTRUN", "BUILDING", "EVALUATING")


def unscored(sid: str, task_id: str, outcome=Outcome.COMPLETED, *, intact=True, tokens=4):
    done = outcome == Outcome.COMPLETED
    policy = "evaluate" if done else ("zero_reward" if intact else "masked")
    trace = Trace(
        trace_id=f"{sid}/0",
        prompt_ids=list(range(100, 100 + tokens)),
        response_ids=list(range(200, 200 + tokens)),
        loss_mask=[1 if intact else 0] * tokens,
        response_logprobs=[-0.5] * tokens,
        reward=None if done else 0.0,
        messages=[{"role": "user", "content": "add"}, {"role": "assistant", "content": "ok"}],
        trainable=intact or done,
    )
    return Trajectory(
        session_id=sid,
        task_id=task_id,
        outcome=outcome,
        builder="prefix_merging",
        traces=[trace],
        reward=None if done else 0.0,
        intact=intact,
        metadata={"reward_policy": policy},
    )


async def new_sessions(reg, task: TaskRequest, to=TO_EVALUATING) -> list[str]:
    _, sessions = await reg.create_task(task)
    for s in sessions:
        for state in to:
            assert (await reg.transition(s.session_id, SessionState(state))).ok
    return [s.session_id for s in sessions]


async def announce(
    bus,
    trajectory: Trajectory,
    *,
    artifacts: Artifacts | None = None,
    eval_runtime_id: str | None = None,
    node: str | None = None,
    msg_id: str | None = None,
) -> None:
    """Store the unscored trajectory and publish TrajectoryBuilt, as the builder does."""
    store = await bus.js.object_store(S.OBJECT_STORE)
    await store.put(
        S.trajectory_object(trajectory.session_id, trajectory.attempt), encode(trajectory)
    )
    event = TrajectoryBuilt(
        session_id=trajectory.session_id,
        task_id=trajectory.task_id,
        outcome=trajectory.outcome,
        attempt=trajectory.attempt,
        artifacts=artifacts or Artifacts(),
        eval_runtime_id=eval_runtime_id,
        node=node,
    )
    mid = msg_id or built_msg_id(trajectory.session_id, trajectory.attempt)
    await bus.publish(event.subject, encode(event), msg_id=mid)


async def delivered(bus, task_id: str) -> list[Trajectory]:
    """Every trajectory on ``polar.trajectories.<task>``, in stream order (read only)."""
    out, seq = [], 1
    while True:
        try:
            msg = await bus.js.get_msg(
                S.STREAM_TRAJECTORIES, seq, subject=S.trajectories(task_id), next=True
            )
        except NotFoundError:
            return out
        out.append(decode(await bus.payload(msg), Trajectory))
        seq = msg.seq + 1


async def remove_built(bus, prefix: str) -> None:
    """Leave no TrajectoryBuilt of a test's tasks in the work queue."""
    seq = 1
    while True:
        try:
            msg = await bus.js.get_msg(
                S.STREAM_SESSIONS, seq, subject=S.ALL_SESSIONS_BUILT, next=True
            )
        except NotFoundError:
            return
        if decode(await bus.payload(msg), TrajectoryBuilt).task_id.startswith(prefix):
            await bus.js.delete_msg(S.STREAM_SESSIONS, msg.seq)
        seq = msg.seq + 1
