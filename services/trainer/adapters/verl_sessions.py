"""The Polar side of verl's agent loop (no verl import): each group of runs verl starts
for one prompt becomes one Polar task, and each run gets back its session.

A group: verl starts the ``n`` runs of one prompt together (same ``uid``, all created
before the first awaits anything: ``AgentLoopWorker.generate_sequences`` and the V1
worker's ``_run_prompt`` both create them in one loop). The first run to arrive yields
once, so its siblings join, then submits one task with ``num_samples`` = the runs that
joined; each run waits for the group (``TrajectoryClient.groups``: all members, or short
after ``group_timeout_seconds``) and takes its own session, by sample index. Polar's
early stop, priority, retries and group-level failure rules therefore apply to verl's
group as to any task.

``output_fields`` turns a session into the fields of verl's ``AgentLoopOutput``: the
main trace's ids, its loss mask as ``response_mask``, its captured logprobs, the
evaluator's reward, MoE routing rows (R3) when Polar captured them, the weight versions
as verl's ``min_global_steps`` / ``max_global_steps`` and Polar's ids in
``extra_fields``. ``exclusion`` says why a session cannot stand in its group's baseline
(its runtime, harness or the system failed, it was cancelled, its evaluation failed, it
sampled nothing, or it never came back); the agent loop reports those to verl as a
failed session (verl_agent_loop.py).

Imports: ``schemas`` and ``services.client`` only (the client side of Polar), so this
runs in verl's own venv (infra/verl.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import orjson

from schemas import (
    CancelTask,
    Outcome,
    TaskRejected,
    TaskRequest,
    Trace,
    Trajectory,
    decode,
    encode,
)
from schemas import subjects as S
from schemas.routing import routing_array
from services.client import Group, TrajectoryClient
from services.client import connection as polar_connection
from services.client.client import routing_blobs

INACTIVE_SECONDS = 24 * 3600.0  # the durable of a worker that died is dropped after this


class PolarError(RuntimeError):
    """A task was refused, or the connection to Polar broke."""


class VerlSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """verl's ``polar:`` config section (examples/verl_grpo/polar_grpo.yaml)."""

    # A TaskRequest without instruction and num_samples: harness (agent), runtime,
    # evaluator, builder, timeouts, retries, early stop, priority.
    task: dict[str, Any] = {}
    task_file: str | None = None  # or that template in a JSON / YAML file
    # A sample's own task fields, merged over the template (its runtime's prepare
    # steps, its evaluator's config): the dataset column of this name, or extra_info's.
    task_field: str = "polar_task"
    nats_url: str | None = None  # None: $POLAR_ENV_FILE's (the file `polar up` writes)
    group_timeout_seconds: float = 1800.0  # a group quiet this long comes back short
    # How a failed session reaches verl: "raise" (verl's V1 trainer leaves it out of the
    # group), "mask" (a masked row at the group's mean reward), "auto" (by trainer.use_v1)
    failed: str = "auto"

    def __post_init__(self) -> None:
        if self.failed not in ("auto", "raise", "mask"):
            raise ValueError(f"polar.failed must be auto, raise or mask, not {self.failed!r}")

    def template(self) -> dict[str, Any]:
        if self.task_file is None:
            return dict(self.task)
        raw = Path(self.task_file).read_bytes()
        if self.task_file.endswith((".yaml", ".yml")):
            import yaml

            return merged(yaml.safe_load(raw), self.task)
        return merged(orjson.loads(raw), self.task)


# -- pure: tasks out --------------------------------------------------------------------


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` on ``base``, dictionaries merged key by key (a sample sets only its
    evaluator's ``config.command``, say), anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def instruction_of(raw_prompt: Any) -> str:
    """verl's ``raw_prompt`` (chat messages) as a task instruction: its last user
    message's text (typed parts: the text ones); a string as it is."""
    if isinstance(raw_prompt, str):
        return raw_prompt
    for message in reversed(list(raw_prompt)):
        if isinstance(message, Mapping) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            return "".join(p.get("text", "") for p in content or [] if isinstance(p, Mapping))
    raise PolarError(f"cannot make an instruction of raw_prompt {raw_prompt!r}: no user message")


def sample_overrides(sample: Mapping[str, Any], task_field: str) -> dict[str, Any]:
    """A sample's own task fields: its ``task_field`` column, else ``extra_info``'s; a
    mapping, or its JSON (what examples/verl_grpo/make_data.py writes)."""
    own = sample.get(task_field)
    if own is None and isinstance(sample.get("extra_info"), Mapping):
        own = sample["extra_info"].get(task_field)
    if isinstance(own, str | bytes):
        own = orjson.loads(own)
    return dict(own or {})


def task_request(
    template: Mapping[str, Any],
    sample: Mapping[str, Any],
    task_id: str,
    num_samples: int,
    task_field: str = "polar_task",
) -> dict[str, Any]:
    """The TaskRequest (JSON-ready, checked against the contract) for a group of
    ``num_samples`` runs of ``sample``."""
    request = merged(template, sample_overrides(sample, task_field))
    request.setdefault("instruction", instruction_of(sample.get("raw_prompt", "")))
    request["task_id"], request["num_samples"] = task_id, num_samples
    meta = {"verl_uid": str(sample.get("uid", "")), "verl_index": _plain(sample.get("index"))}
    request["metadata"] = {**request.get("metadata", {}), **meta}
    try:
        msgspec.convert(request, TaskRequest)
    except msgspec.ValidationError as exc:
        raise PolarError(f"the polar task for verl sample {meta}: {exc}") from None
    return request


def _plain(value: Any) -> Any:
    """A numpy scalar from verl's batch as a JSON value."""
    return value.item() if hasattr(value, "item") else value


# -- pure: sessions back ----------------------------------------------------------------


def main_trace(t: Trajectory) -> Trace | None:
    """The trace verl trains on: trainable, not a side call, most sampled tokens (the
    TRL and slime adapters' choice)."""
    main = [tr for tr in t.traces if tr.trainable and any(tr.loss_mask) and not tr.side_call]
    return max(main, key=lambda tr: sum(tr.loss_mask), default=None)


def exclusion(t: Trajectory | None) -> str | None:
    """Why a session cannot stand in its group's baseline, or None. A timed-out session
    stays: its reward 0 (by rule) judges the policy, which ran too long."""
    if t is None:
        return "missing: its group came back without it (polar.group_timeout_seconds)"
    if t.outcome == Outcome.ERROR:
        return f"failed: {t.metadata.get('finish_reason') or t.eval_reason or 'error'}"
    if t.outcome == Outcome.CANCELLED:
        return f"cancelled: {t.metadata.get('finish_reason') or 'by the user or early stop'}"
    if t.eval_status != "ok" or t.reward is None:
        return f"evaluation failed: {t.eval_reason}"
    if main_trace(t) is None:
        return "sampled nothing"
    return None


def versions(trace: Trace, fallback: int) -> tuple[int, int, bool]:
    """(first, last) weight version of the trace's sampled tokens as verl counts them
    (``min_global_steps``, ``max_global_steps``: integers), and whether Polar knew them;
    ``fallback`` (the step verl issued the prompt at) where the engine named none."""
    known = [int(s.version) for s in trace.version_spans if s.version.lstrip("-").isdigit()]
    if not known:
        return fallback, fallback, False
    return min(known), max(known), True


def leading_routing(trace: Trace, read: Mapping[str, bytes]) -> Any | None:
    """The MoE routing rows (int ``[rows, layers, top_k]``) of the trace's leading
    positions that have them: every token but the last for an engine that returned them
    all. verl places them from the prompt's first token and zero-fills the rest, as for
    its own engine's rows."""
    if trace.routing is None:
        return None
    n = len(trace.prompt_ids) + len(trace.response_ids)
    experts, present = routing_array(trace.routing, n, read)
    rows = int(present.argmin()) if not present.all() else n
    return experts[:rows]


@dataclass(frozen=True)
class Limits:
    """verl's batch widths (``rollout.prompt_length``, ``rollout.response_length``)."""

    prompt: int
    response: int


def output_fields(
    t: Trajectory,
    limits: Limits,
    *,
    global_steps: int = 0,
    seconds: float = 0.0,
    routing: Mapping[str, bytes] | None = None,
) -> dict[str, Any]:
    """``AgentLoopOutput`` keyword arguments for a session that stands in its group
    (``exclusion`` is None). A trace longer than verl's widths is cut as verl's own
    loops cut theirs (the prompt's start, the response's end) and says so."""
    trace = main_trace(t)
    assert trace is not None, "output_fields needs a session with a main trace"
    prompt = list(trace.prompt_ids)[-limits.prompt :]
    n = min(len(trace.response_ids), limits.response)
    first, last, known = versions(trace, global_steps)
    fields: dict[str, Any] = {
        "prompt_ids": prompt,
        "response_ids": list(trace.response_ids[:n]),
        "response_mask": list(trace.loss_mask[:n]),
        "response_logprobs": [0.0 if lp is None else lp for lp in trace.response_logprobs[:n]],
        "reward_score": float(t.reward),
        "num_turns": len(trace.messages) or 2,
        "metrics": {"generate_sequences": seconds, "tool_calls": 0.0},
        "extra_fields": {
            **polar_ids(t),
            "polar_trace_id": trace.trace_id,
            "polar_version_spans": [[s.version, s.start, s.end] for s in trace.version_spans],
            "polar_versions_known": known,
            "polar_cut": [len(trace.prompt_ids) - len(prompt), len(trace.response_ids) - n],
            "min_global_steps": first,
            "max_global_steps": last,
            "turn_scores": [],
            "tool_rewards": [],
        },
    }
    cut = len(prompt) < len(trace.prompt_ids)  # rows would no longer line up with tokens
    if trace.routing is not None and routing is not None and not cut:
        fields["routed_experts"] = leading_routing(trace, routing)[: len(prompt) + n]
    return fields


def masked_fields(
    t: Trajectory | None,
    why: str,
    baseline: float,
    *,
    pad_id: int,
    global_steps: int = 0,
    seconds: float = 0.0,
) -> dict[str, Any]:
    """``AgentLoopOutput`` keyword arguments for a session left out, where verl cannot
    leave a row out (its legacy trainer): one masked token, so it trains nothing, at
    ``baseline`` (the mean reward of the group's members that stand), so the group's
    mean does not move."""
    ids = polar_ids(t) if t is not None else {}
    return {
        "prompt_ids": [pad_id],
        "response_ids": [pad_id],
        "response_mask": [0],
        "response_logprobs": [0.0],
        "reward_score": baseline,
        "num_turns": 0,
        "metrics": {"generate_sequences": seconds, "tool_calls": 0.0},
        "extra_fields": {
            **ids,
            "polar_excluded": why,
            "min_global_steps": global_steps,
            "max_global_steps": global_steps,
            "turn_scores": [],
            "tool_rewards": [],
        },
    }


def polar_ids(t: Trajectory) -> dict[str, Any]:
    return {
        "polar_session_id": t.session_id,
        "polar_task_id": t.task_id,
        "polar_attempt": t.attempt,
        "polar_outcome": str(t.outcome),
        "polar_eval_status": t.eval_status,
        "polar_reward": t.reward,
    }


def baseline(members: list[Trajectory | None]) -> float:
    """The mean reward of the members that stand in the group (0.0 when none does)."""
    rewards = [float(t.reward) for t in members if exclusion(t) is None]
    return sum(rewards) / len(rewards) if rewards else 0.0


def by_sample(group: Group, size: int) -> list[Trajectory | None]:
    """The group's sessions in sample order; None for one a short group lacks."""
    out: list[Trajectory | None] = [None] * size
    for t in group.trajectories:
        i = t.metadata.get("sample_index")
        if isinstance(i, int) and 0 <= i < size:
            out[i] = t
    return out


# -- I/O: the worker's connection and its groups in flight ---------------------------------


@dataclass
class Forming:
    """One group of runs: joined while verl starts them, then one task."""

    uid: str
    limit: float  # seconds a run waits before it counts its session missing
    size: int = 0
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    task_id: str | None = None
    submitted_at: float = 0.0
    waiting: int = 0  # runs still waiting for it (verl may cancel them)


@dataclass
class Session:
    """What a run gets back: its session (None: missing from a short group), the whole
    group in sample order, the rows its traces' routing names, seconds since submission."""

    trajectory: Trajectory | None
    members: list[Trajectory | None]
    routing: dict[str, bytes]
    seconds: float


class PolarGroups:
    """One per verl worker process: a durable ``TrajectoryClient`` of its own (it starts
    at its creation and sees the groups of the tasks submitted after; other workers'
    groups are committed unread), the tasks it submitted, the runs waiting for them."""

    def __init__(self, settings: VerlSettings) -> None:
        self.settings, self.template = settings, settings.template()
        self.prefix = f"verl-{uuid.uuid4().hex[:8]}"
        self.forming: dict[str, Forming] = {}  # uid -> the group its runs are joining
        self.in_flight: dict[str, Forming] = {}  # task id -> submitted group
        self.foreign = 0
        self._count = 0
        self._client: TrajectoryClient | None = None
        self._connecting: asyncio.Lock | None = None
        self._pump: asyncio.Task | None = None
        self._rejected_sub = None
        # run before each task goes out (the agent loop sets its engines' versions here)
        self.before_submit: Callable[[], Awaitable[None]] | None = None

    # -- one run ------------------------------------------------------------------------
    async def session(self, uid: str, sample: Mapping[str, Any]) -> Session:
        """This run's session: the first run of ``uid`` submits the group's task once
        its siblings have joined; every run waits for the group and takes its own."""
        group = self.forming.get(uid)
        first = group is None
        if group is None:
            own = merged(self.template, sample_overrides(sample, self.settings.task_field))
            limit = wait_limit(own, self.settings.group_timeout_seconds)
            group = self.forming[uid] = Forming(uid, limit=limit)
        slot, group.size = group.size, group.size + 1
        group.waiting += 1
        if first:
            await self._submit_when_joined(group, sample)
        try:
            members, routing = await asyncio.wait_for(asyncio.shield(group.done), group.limit)
        except TimeoutError:  # not one member came back in time: the group is missing
            members, routing = [None] * group.size, {}
            self._left(group)
        except asyncio.CancelledError:
            self._left(group)
            raise
        else:
            group.waiting -= 1
        seconds = time.monotonic() - group.submitted_at
        return Session(members[slot], members, routing, seconds)

    async def _submit_when_joined(self, group: Forming, sample: Mapping[str, Any]) -> None:
        try:
            await asyncio.sleep(0)  # the siblings verl created with this run join first
        finally:
            self.forming.pop(group.uid, None)
        try:
            await self._connect()
            if self.before_submit is not None:
                await self.before_submit()
            self._count += 1
            task_id = f"{self.prefix}-{self._count:06d}"
            request = task_request(
                self.template, sample, task_id, group.size, self.settings.task_field
            )
            group.task_id, group.submitted_at = task_id, time.monotonic()
            self.in_flight[task_id] = group
            await self._client.bus.publish(
                S.TASKS_SUBMIT, orjson.dumps(request), msg_id=f"submit:{task_id}"
            )
        except Exception as exc:  # every run of the group learns why, not only this one
            if group.task_id is not None:
                self.in_flight.pop(group.task_id, None)
            if not group.done.done():
                group.done.set_exception(exc)

    def _left(self, group: Forming) -> None:
        """A run stopped waiting (verl cancelled it, or it gave up); once none waits, the
        task is cancelled in Polar too."""
        group.waiting -= 1
        if group.waiting == 0 and group.task_id and group.task_id in self.in_flight:
            self.in_flight.pop(group.task_id)
            if not group.done.done():
                group.done.cancel()
            reason = "verl stopped waiting for the group"
            asyncio.get_running_loop().create_task(self.cancel(group.task_id, reason))

    async def cancel(self, task_id: str, reason: str) -> None:
        """Cancel a task in Polar: its sessions stop and come back CANCELLED."""
        await self._connect()
        event = CancelTask(ts=time.time(), task_id=task_id, reason=reason)
        await self._client.bus.publish(S.TASKS_CANCEL, encode(event))

    # -- the connection -----------------------------------------------------------------
    async def _connect(self) -> None:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._client is not None:
                return
            url = polar_connection.nats_url(self.settings.nats_url)
            client = TrajectoryClient(
                url,
                durable=f"{self.prefix}-groups",
                start="new",
                group_timeout=self.settings.group_timeout_seconds,
                poll_seconds=0.2,
                inactive_threshold=INACTIVE_SECONDS,
            )
            await client.connect()
            self._rejected_sub = await client.bus.nc.subscribe(
                S.TASKS_REJECTED, cb=self._on_rejected
            )
            self._client = client
            self._pump = asyncio.get_running_loop().create_task(self._take_groups())

    async def close(self) -> None:
        """Disconnect and delete this worker's durable (nobody resumes it)."""
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.delete_consumer()
            await self._client.close()
            self._client = None

    async def _on_rejected(self, msg) -> None:
        with contextlib.suppress(Exception):
            event = decode(msg.data, TaskRejected)
            group = self.in_flight.pop(event.task_id or "", None)
            if group is not None and not group.done.done():
                group.done.set_exception(PolarError(f"task {event.task_id}: {event.reason}"))

    async def _take_groups(self) -> None:
        assert self._client is not None
        try:
            async for group in self._client.groups():
                await self._deliver(group)
        except Exception as exc:  # the runs waiting would wait forever: tell them
            for forming in list(self.in_flight.values()):
                if not forming.done.done():
                    forming.done.set_exception(PolarError(f"Polar's group reader died: {exc!r}"))
            raise

    async def _deliver(self, group: Group) -> None:
        forming = self.in_flight.pop(group.task_id, None)
        if forming is None:  # another worker's task (or one verl cancelled)
            self.foreign += 1
            await group.commit()
            return
        members = by_sample(group, forming.size)
        traces = [tr for t in members if t is not None for tr in t.traces if tr.routing]
        routing = await routing_blobs(self._client.bus, traces) if traces else {}
        await group.commit()  # verl owns them now (it re-issues prompts it loses)
        if not forming.done.done():
            forming.done.set_result((members, routing))


def wait_limit(request: Mapping[str, Any], group_timeout: float) -> float:
    """How long a run waits for its group before counting its session missing: every
    attempt Polar may make of a session (each within ``timeout_seconds``), then the group
    timeout."""
    attempts = 1 + request.get("max_retries", 0) + request.get("infra_retries", 2)
    return attempts * float(request.get("timeout_seconds", 3600.0)) + group_timeout


_GROUPS: dict[tuple[int, bytes], PolarGroups] = {}


def groups_for(settings: VerlSettings) -> PolarGroups:
    """The worker process's ``PolarGroups`` for these settings on the running loop (verl
    makes an agent loop per run; they share it)."""
    key = (id(asyncio.get_running_loop()), msgspec.json.encode(settings))
    if key not in _GROUPS:
        _GROUPS[key] = PolarGroups(settings)
    return _GROUPS[key]
