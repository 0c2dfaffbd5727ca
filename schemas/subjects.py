"""Every NATS subject, JetStream stream/consumer name and Redis key prefix, in one place.

Session and task ids are validated to be NATS-token safe (no dots, spaces or wildcards),
so they can be embedded in subjects directly.
"""

from __future__ import annotations

# -- subjects -----------------------------------------------------------------------
TASKS_SUBMIT = "polar.tasks.submit"  # a TaskRequest to run (the scheduler consumes it)
TASKS_CANCEL = "polar.tasks.cancel"  # payload: CancelTask
TASKS_REJECTED = "polar.tasks.rejected"  # TaskRejected: a task message refused, and why
TASKS_ACCEPTED = "polar.tasks.accepted"  # TaskAccepted: a task and its sessions' ids


def task_result(task_id: str) -> str:
    """The task's TaskResult, once every session has ended."""
    return f"polar.tasks.{task_id}.result"


SESSIONS_INIT = "polar.sessions.init"  # one InitWork per session, consumed by runtime pools


def sessions_ready(node: str) -> str:
    """READY sessions handed to one node's executor."""
    return f"polar.sessions.ready.{node}"


SESSIONS_FINISHED = "polar.sessions.finished"  # SessionFinished, consumed by builders
# TrajectoryBuilt, consumed by evaluators: any evaluator's, or, when the evaluation needs
# a runtime the session left on its node (live, or prewarmed), that node's evaluator's
SESSIONS_BUILT_ANY = "polar.sessions.built.any"
ALL_SESSIONS_BUILT = "polar.sessions.built.>"  # every TrajectoryBuilt, whoever's
_BUILT_ON = "polar.sessions.built.node."


def sessions_built_on(node: str) -> str:
    """TrajectoryBuilt whose evaluation needs a runtime left on ``node``."""
    return _BUILT_ON + node


def built_node(subject: str) -> str | None:
    """The node of a ``sessions_built_on`` subject (None for any other subject)."""
    return subject[len(_BUILT_ON) :] if subject.startswith(_BUILT_ON) else None


# SessionScored: a record for observers (the scheduler tracks terminal state events), so
# it lives in the age-limited events stream, not in a work queue nobody drains.
SESSIONS_SCORED = "polar.events.scored"


def session_event(state: str) -> str:
    """SessionStateChanged: a session entered ``state``."""
    return f"polar.events.session.{state.lower()}"


SESSION_EVENTS = "polar.events.session.>"  # every session_event (the scheduler follows them)


def session_cancel(session_id: str) -> str:
    """Core-NATS broadcast: whoever holds the session stops it."""
    return f"polar.control.cancel.{session_id}"


def completions(session_id: str) -> str:
    """The session's CompletionRecords, one per model call (the proxy's)."""
    return f"polar.completions.{session_id}"


def completion_msg_id(session_id: str, seq: int) -> str:
    """The dedupe id of a session's record ``seq``: a retried publish of one call is
    dropped (the proxy's records, and an evaluator's side calls)."""
    return f"{session_id}:{seq}"


def trajectories(task_id: str) -> str:
    """The task's scored Trajectories, delivered once each (trainers read them)."""
    return f"polar.trajectories.{task_id}"


def regrades(regrade_id: str, task_id: str) -> str:
    """Re-graded trajectories (``polar regrade``): apart from ``polar.trajectories.>``,
    so a trainer never takes a re-grade for a new sample unless it asks for them."""
    return f"polar.regrades.{regrade_id}.{task_id}"


def dead_letter(stream: str) -> str:
    """Messages of ``stream`` that failed too often, with the reason."""
    return f"polar.dlq.{stream.lower()}"


# What each stream holds (services/common/bus.py creates them).
ALL_TASKS = "polar.tasks.>"
ALL_SESSIONS = "polar.sessions.>"  # POLAR_SESSIONS: the session work queues
ALL_EVENTS = "polar.events.>"  # POLAR_EVENTS: state changes, scores, heartbeats
ALL_COMPLETIONS = "polar.completions.>"  # POLAR_COMPLETIONS: every model call's record
ALL_TRAJECTORIES = "polar.trajectories.>"  # POLAR_TRAJECTORIES: scored trajectories
ALL_REGRADES = "polar.regrades.>"  # POLAR_REGRADES: re-graded trajectories
ALL_DEAD_LETTERS = "polar.dlq.>"  # POLAR_DLQ: dead letters


NODE_HEARTBEAT = "polar.nodes.heartbeat"  # NodeHeartbeat: a node's sessions and bounds per stage

# -- JetStream streams --------------------------------------------------------------
STREAM_TASKS = "POLAR_TASKS"  # polar.tasks.>
STREAM_SESSIONS = "POLAR_SESSIONS"  # polar.sessions.> (work queues)
STREAM_EVENTS = "POLAR_EVENTS"  # polar.events.> (lifecycle log)
STREAM_COMPLETIONS = "POLAR_COMPLETIONS"  # polar.completions.>
STREAM_TRAJECTORIES = "POLAR_TRAJECTORIES"  # polar.trajectories.>
STREAM_REGRADES = "POLAR_REGRADES"  # polar.regrades.>
STREAM_DLQ = "POLAR_DLQ"  # polar.dlq.>
OBJECT_STORE = "polar-blobs"  # claim-check for payloads over the NATS limit
# What the shared consumer knows of a message's earlier deliveries (which ended in a nak,
# which one ran alone): services/common/quarantine.py, the only writer
DELIVERIES_BUCKET = "polar-deliveries"


def delivery_key(consumer: str, stream: str, seq: int) -> str:
    """Key of one stream message's delivery record, per durable consumer."""
    return f"{consumer}.{stream}.{seq}"


def image_object(digest: str) -> str:
    """Object-store name of a prompt image's bytes, by its digest ("sha256:<hex>"): the
    proxy writes it before the record that names it; trainers read it."""
    return "images/" + digest.replace(":", "-")


def routing_object(session_id: str, attempt: int, seq: int) -> str:
    """Object-store name of a call's MoE routing rows (``schemas.routing``): the proxy
    writes it before the record that names it; trainers read it through a trace."""
    return f"routing/{session_id}/{attempt}/{seq}"


def trajectory_object(session_id: str, attempt: int) -> str:
    """Object-store name of a built trajectory (the builder writes, the evaluator reads)."""
    return f"trajectories/{session_id}/{attempt}"


def artifacts_object(session_id: str, attempt: int) -> str:
    """Object-store name of a finished run's artifacts (the builder writes them beside
    its trajectory; the dashboard reads them after a restart, when the bus no longer has
    the SessionFinished that carried them)."""
    return f"artifacts/{session_id}/{attempt}"


# -- durable consumers --------------------------------------------------------------
CONSUMER_SCHEDULER_SUBMIT = "scheduler-submit"  # the scheduler's, on TASKS_SUBMIT
CONSUMER_SCHEDULER_CANCEL = "scheduler-cancel"  # the scheduler's, on TASKS_CANCEL
# the scheduler's, on SESSION_EVENTS
CONSUMER_SCHEDULER_EVENTS = "scheduler-events"
CONSUMER_POOL_INIT = "pool-init"  # the runtime pools', on SESSIONS_INIT (shared)
CONSUMER_BUILDER = "builder"  # the builders', on SESSIONS_FINISHED (shared)
CONSUMER_EVALUATOR = "evaluator"  # the evaluators', on SESSIONS_BUILT_ANY (shared)


def consumer_executor(node: str) -> str:
    """The durable of ``sessions_ready(node)``: that node's executor's."""
    return f"executor-{node}"


def consumer_evaluator_on(node: str) -> str:
    """The durable of ``sessions_built_on(node)``: the evaluators that reach the node's
    runtimes share it (``CONSUMER_EVALUATOR`` takes ``SESSIONS_BUILT_ANY``)."""
    return f"evaluator-{node}"


# -- Redis keys ---------------------------------------------------------------------
REDIS_PREFIX = "polar:"  # every key Polar writes starts with it


def key_session(session_id: str) -> str:
    """Hash: the session's registry record (Session)."""
    return f"polar:session:{session_id}"


def key_task(task_id: str) -> str:
    """Hash: the task's record, its spec included."""
    return f"polar:task:{task_id}"


def key_task_sessions(task_id: str) -> str:
    """List of the task's session ids, in order."""
    return f"polar:task:{task_id}:sessions"


def key_task_counts(task_id: str) -> str:
    """Hash state -> number of the task's sessions in that state (kept by the CAS script)."""
    return f"polar:task:{task_id}:counts"


def key_token(token: str) -> str:
    """The session a proxy token belongs to, while the session runs."""
    return f"polar:token:{token}"


def key_call_seq(session_id: str) -> str:
    """Counter of the session's model calls the proxy has numbered (all attempts), and
    its evaluator's side calls after them (``proxy/callcount.py``)."""
    return f"polar:seq:{session_id}"


KEY_TITO_PREFIX = "polar:tito:"  # + "<session id>:<attempt>": the proxy's token-mode turns


def key_tito(session_id: str, attempt: int) -> str:
    """List of a session attempt's TITO turn states (the proxy's, for prefix reuse)."""
    return f"{KEY_TITO_PREFIX}{session_id}:{attempt}"


def key_claim(name: str) -> str:
    """A short exclusive claim on a one-off job (Registry.claim)."""
    return f"polar:claim:{name}"


def key_ticket(service: str, nonce: str) -> str:
    """Set once, until its ticket expires: a sign-in link of ``service``'s that was used
    (services/common/auth.py), so no restart or replica takes it again."""
    return f"polar:ticket:{service}:{nonce}"


def key_submit_dedupe(digest: str) -> str:
    """String "<task id> <published at>": the first anonymous task message with these
    exact bytes (sha256 hex), so a copy published soon after joins its task."""
    return f"polar:submit:{digest}"


KEY_STATE_COUNTS = "polar:counts"  # global hash state -> count
# Counter giving every applied transition its place in one global order (transition.lua)
KEY_TRANSITION_SEQ = "polar:transition_seq"
# A random id written once into a fresh registry; a service that sees it change or vanish
# knows the registry lost its state (services/common/host.py stops the service).
KEY_REGISTRY_EPOCH = "polar:registry:epoch"
KEY_TASKS_ACTIVE = "polar:tasks:active"  # set of task ids not yet finished
KEY_NODES = "polar:nodes"  # hash "<node>/<service>" -> last NodeHeartbeat json
# The outbox (services/common/outbox.py): messages that must follow a registry change,
# kept until the bus has them. Hash msg id -> "<subject>\n<payload>"; sorted set msg id ->
# when it was kept (the relay publishes those older than its grace).
KEY_OUTBOX = "polar:outbox"
KEY_OUTBOX_DUE = "polar:outbox:due"  # sorted set: msg id -> when it was kept (see KEY_OUTBOX)


def key_node_state(node: str, state: str) -> str:
    """Set of the sessions placed on ``node`` that are in ``state`` (kept by the CAS script)."""
    return f"polar:node:{node}:{state}"


KEY_LEASES = "polar:leases"  # sorted set: session id -> lease expiry (epoch seconds)
KEY_BACKPRESSURE = "polar:backpressure"  # set (with a TTL) while the inference engine struggles


def key_cancel_asked(session_id: str) -> str:
    """A cancel asked of a session past its run (services/common/cancels.py)."""
    return f"{REDIS_PREFIX}cancel:{session_id}"


def key_lease(session_id: str) -> str:
    """A session's own lease key (the services keep every lease in KEY_LEASES)."""
    return f"polar:lease:{session_id}"


def key_eval(session_id: str, attempt: int) -> str:
    """Hash: one evaluation's result and whether its trajectory was published (so a
    redelivered evaluation reuses the first result instead of evaluating again)."""
    return f"polar:eval:{session_id}:{attempt}"
