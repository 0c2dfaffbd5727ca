"""The Polar side of every trainer adapter: prompts out as tasks, whole groups back.

``PolarRollouts`` gives a synchronous trainer loop (TRL's ``rollout_func``, slime's
rollout hook) Polar's asynchronous pipeline: a background thread runs an event loop
holding the NATS connection and a ``TrajectoryClient`` (a durable that starts at its
creation, so it sees exactly the tasks submitted after it). Each prompt becomes one task
of ``num_samples`` sessions, made from a task template (runtime, agent, builder,
evaluator); its group comes back whole, or short with ``complete=False`` once no member
arrived for ``group_timeout`` seconds. Groups are committed only when the trainer says
so (``commit_pending``, after its optimizer step), so a trainer that dies first gets
them again.

    rollouts = PolarRollouts(nats_url, template).start()  # nats_url None: the environment's
    groups = rollouts.run(["2+2=?", "3+5=?"], num_samples=4)   # one Group per prompt
    ...train...
    rollouts.commit_pending()
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any

import orjson

from schemas import TaskRejected, decode
from schemas import subjects as S
from services.client import Group, TrajectoryClient, connection
from services.client.client import routing_blobs
from services.common.bus import Bus
from services.common.tasks import cancel_and_wait

INACTIVE_SECONDS = 24 * 3600.0  # a durable it named itself, left by a process that died


class RolloutError(RuntimeError):
    """A task was refused, or its group did not come back in time."""


def prompt_text(prompt: Any) -> str:
    """A trainer's prompt as a task instruction: text as is; a conversation (a list of
    messages, TRL's conversational format) gives its last user message's text."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        for message in reversed(prompt):
            if isinstance(message, dict) and message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, str):
                    return content
                if isinstance(content, list):  # typed parts: the text ones
                    return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise RolloutError(f"cannot make an instruction of prompt {prompt!r}: text or messages")


def task_request(
    template: dict[str, Any],
    task_id: str,
    instruction: str,
    num_samples: int,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The TaskRequest (as JSON-ready dict) for one prompt: the template with this
    prompt's id, instruction, group size and metadata."""
    return {
        **template,
        "task_id": task_id,
        "instruction": instruction,
        "num_samples": num_samples,
        "metadata": {**template.get("metadata", {}), **(metadata or {})},
    }


class PolarRollouts:
    def __init__(
        self,
        nats_url: str | None,
        template: dict[str, Any],
        *,
        durable: str | None = None,
        prefix: str | None = None,
        group_timeout: float = 600.0,
        collect_timeout: float | None = None,
    ) -> None:
        """``template``: a TaskRequest without instruction and num_samples (the prompt
        and group size fill them). ``group_timeout``: a group quiet that long comes back
        short (``complete=False``). ``collect_timeout``: how long ``collect`` waits in
        all before it raises (None: as long as it takes). ``nats_url`` None: the stack's
        from the environment (``$POLAR_ENV_FILE``, the file ``polar up`` writes, or
        ``$POLAR_NATS_URL``). Without a ``durable`` of its own, the one it makes is
        deleted at ``close`` (no later process can resume it) and dropped by the server
        after ``INACTIVE_SECONDS`` without a client (a process that died)."""
        self.nats_url, self.template = connection.nats_url(nats_url), dict(template)
        self.prefix = prefix or f"polar-{uuid.uuid4().hex[:8]}"
        self.own_durable = durable is None
        self.durable = durable or f"{self.prefix}-trainer"
        self.group_timeout, self.collect_timeout = group_timeout, collect_timeout
        self.submitted: set[str] = set()
        self.pending: list[Group] = []  # handed out, not committed yet
        self.foreign = 0  # groups of tasks this object did not submit (committed, skipped)
        self._count = 0
        self._ready: dict[str, Group] = {}
        self._rejected: dict[str, str] = {}
        self._arrived: asyncio.Event | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._bus: Bus | None = None
        self._client: TrajectoryClient | None = None
        self._pump: asyncio.Task | None = None
        self._subs: list = []

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> PolarRollouts:
        self._thread.start()
        self._run(self._connect())
        return self

    def close(self) -> None:
        """Disconnect; what was handed out and not committed is released (redelivered)."""
        if self._thread.is_alive():
            self._run(self._disconnect())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> PolarRollouts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _connect(self) -> None:
        self._arrived = asyncio.Event()
        self._bus = await Bus.open(self.nats_url, f"{self.prefix}-rollouts", declare=False)
        self._subs.append(await self._bus.nc.subscribe(S.TASKS_REJECTED, cb=self._on_rejected))
        self._client = TrajectoryClient(
            self.nats_url,
            durable=self.durable,
            start="new",
            group_timeout=self.group_timeout,
            poll_seconds=0.2,
            inactive_threshold=INACTIVE_SECONDS if self.own_durable else None,
        )
        await self._client.connect()
        self._pump = asyncio.create_task(self._take_groups())

    async def _disconnect(self) -> None:
        if self._pump is not None:
            await cancel_and_wait([self._pump])
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._client is not None:
            if self.own_durable:  # nobody can resume a durable named at random
                with contextlib.suppress(Exception):
                    await self._client.delete_consumer()
            await self._client.close()
        if self._bus is not None:
            await self._bus.close()

    # -- tasks out ----------------------------------------------------------------------
    def submit(
        self,
        prompts: Sequence[Any],
        num_samples: int,
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> list[str]:
        """One task per prompt (``num_samples`` sessions each); their task ids, in order."""
        if num_samples < 1:
            raise RolloutError(f"num_samples must be >= 1, not {num_samples}")
        requests = []
        for i, prompt in enumerate(prompts):
            self._count += 1
            task_id = f"{self.prefix}-{self._count:06d}"
            meta = {"prompt_index": i, **(metadata[i] if metadata else {})}
            requests.append(
                task_request(self.template, task_id, prompt_text(prompt), num_samples, meta)
            )
        self._run(self._publish(requests))
        return [r["task_id"] for r in requests]

    async def _publish(self, requests: list[dict[str, Any]]) -> None:
        assert self._bus is not None
        for request in requests:
            self.submitted.add(request["task_id"])
            await self._bus.publish(
                S.TASKS_SUBMIT, orjson.dumps(request), msg_id=f"submit:{request['task_id']}"
            )

    async def _on_rejected(self, msg) -> None:
        with contextlib.suppress(Exception):
            event = decode(msg.data, TaskRejected)
            if event.task_id in self.submitted:
                self._rejected[event.task_id] = event.reason
                self._arrived.set()

    # -- groups back --------------------------------------------------------------------
    def collect(self, task_ids: Sequence[str], timeout: float | None = None) -> list[Group]:
        """The groups of ``task_ids``, in that order, once each is back (whole, or short
        after the group timeout). They join ``pending`` until ``commit_pending``."""
        limit = self.collect_timeout if timeout is None else timeout
        groups = self._run(self._collect(list(task_ids), limit))
        self.pending.extend(groups)
        return groups

    def run(self, prompts: Sequence[Any], num_samples: int, **kw) -> list[Group]:
        """``submit`` then ``collect``."""
        return self.collect(self.submit(prompts, num_samples, kw.get("metadata")))

    def routing(self, groups: Sequence[Group]) -> dict[str, bytes]:
        """The MoE routing rows the groups' traces name, by object (empty for a dense
        model): what ``schemas.routing.routing_array`` reads."""
        traces = [tr for g in groups for t in g.trajectories for tr in t.traces if tr.routing]
        if not traces:
            return {}
        assert self._bus is not None, "start() first"
        return self._run(routing_blobs(self._bus, traces))

    def commit_pending(self) -> int:
        """Commit every group handed out so far (the trainer has used them)."""
        groups, self.pending = self.pending, []
        for group in groups:
            self._run(group.commit())
        return len(groups)

    async def _collect(self, task_ids: list[str], limit: float | None) -> list[Group]:
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            if self._pump is not None and self._pump.done():  # the consumer loop died
                raise RolloutError(f"trajectory consumer stopped: {self._pump.exception()!r}")
            refused = [t for t in task_ids if t in self._rejected]
            if refused:
                raise RolloutError(f"task {refused[0]} was rejected: {self._rejected[refused[0]]}")
            if all(t in self._ready for t in task_ids):
                return [self._ready.pop(t) for t in task_ids]
            self._arrived.clear()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                missing = [t for t in task_ids if t not in self._ready]
                raise RolloutError(f"{len(missing)} group(s) not back in {limit}s: {missing[:5]}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)

    async def _take_groups(self) -> None:
        assert self._client is not None
        async for group in self._client.groups():
            if group.task_id not in self.submitted:
                self.foreign += 1  # another trainer's task on this subject space
                await group.commit()
                continue
            self._ready[group.task_id] = group
            self._arrived.set()
