"""Replay: a recorded session's calls answered from its records (``polar replay``).

A replay is a task whose ``replay`` names a recorded session (``schemas.ReplaySpec``);
its sessions' call lookups carry that spec (``registry.SESSION_FOR_CALL``). Each call
numbered below ``until`` (every call, without one) is answered from the recorded call of
the same number, and no engine is called:

* its request is compared with the recorded one (``replay_diff.request_diff``: the
  normalized messages and tools, and the sampling parameters). Equal, or different only
  where a harness differs from run to run (a date, a timestamp, a random id:
  ``RequestDiff.only_nondeterministic``), it is answered with the recorded answer: the
  same text, reasoning and tool calls (their ids too, which the harness sends back), in
  the caller's protocol, and recorded with the recorded tokens, marked as replayed
  (``CompletionRecord.replay``);
* otherwise the replay diverged: the call is recorded as a failed call whose error is the
  report (the call's number and which field differs, both sides quoted), the harness gets
  a 409 in its protocol, and every later call of that session the same.

A fork (``until`` = K) answers its first K calls so, and sends the rest to the engine as
usual: they extend the replayed calls' tokens, which the TITO states keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import orjson

from proxy.backends.base import Generation
from proxy.capture import CallContext
from proxy.conversation import AssistantTurn, ToolCall, Usage
from proxy.errors import ProtocolError
from proxy.replay_diff import request_diff, with_sampling
from proxy.tito import PromptPlan, TurnState
from schemas import CompletionRecord, ReplaySpec
from schemas.completion import (
    REPLAY_DIVERGED,
    REPLAY_FAILED,
    REPLAY_REFUSED,
    ReplayMark,
    ToolParse,
    reconstruct_prompts,
)
from services.common.completions import read_completions
from services.common.tokenization.lru import SizedLRU

# Recorded sessions' records kept read per proxy, by their size (a long CLI session's
# records are megabytes: their requests and ids)
RECORDS_BYTES = 256 * 1024 * 1024
DIVERGED = 4096  # replays remembered as diverged per proxy


class ReplayRefusal(ProtocolError):
    """A replayed call answered with an error, which its record keeps (``report``, and
    ``mark``: what the replay did with the call)."""

    def __init__(self, status: int, report: str, mark: ReplayMark) -> None:
        super().__init__(status, report)
        self.report, self.mark = report, mark


class ReplayDiverged(ReplayRefusal):
    """The call is not the recorded one (or comes after one that was not): a 409."""

    def __init__(self, report: str, mark: ReplayMark) -> None:
        super().__init__(409, report, mark)


class ReplayedFailure(ReplayRefusal):
    """The recorded call failed (an engine error): it fails again, as a 503 the harness
    retries as it did (the retry is the next recorded call)."""

    def __init__(self, report: str, mark: ReplayMark) -> None:
        super().__init__(503, report, mark)


@dataclass(frozen=True)
class Replayed:
    """A call answered from the record: its prompt plan and answer as if sampled, the
    turn the harness was told and the parse health recorded, and the record's mark."""

    plan: PromptPlan
    gen: Generation
    turn: AssistantTurn
    health: ToolParse | None
    mark: ReplayMark


def _records_cost(_key: object, records: dict[int, CompletionRecord]) -> int:
    return sum(
        len(r.raw_request) + len(r.normalized) + len(r.reply)
        + 8 * (len(r.prompt_ids) + len(r.output_ids))
        for r in records.values()
    )  # fmt: skip


class Replays:
    def __init__(self, bus) -> None:
        self._bus = bus  # the stack's Bus: records are read back from its stream
        self._specs: SizedLRU[bytes, ReplaySpec] = SizedLRU(1024, lambda _k, _v: 1)
        self._records: SizedLRU[tuple[str, int], dict[int, CompletionRecord]] = SizedLRU(
            RECORDS_BYTES, _records_cost
        )
        self._diverged: SizedLRU[tuple[str, int], str] = SizedLRU(DIVERGED, lambda _k, _v: 1)

    def spec(self, raw: bytes) -> ReplaySpec:
        spec = self._specs.get(raw)
        if spec is None:
            spec = msgspec.json.decode(raw, type=ReplaySpec)
            self._specs.put(raw, spec)
        return spec

    async def recorded(self, spec: ReplaySpec, mark: ReplayMark) -> dict[int, CompletionRecord]:
        """The recorded attempt's records by number, read once per proxy while kept."""
        key = (spec.session_id, spec.attempt)
        records = self._records.get(key)
        if records is None:
            read, problems = await read_completions(self._bus, spec.session_id)
            if problems:
                raise ReplayDiverged(
                    f"the recorded session {spec.session_id} cannot be read back: {problems[0]}",
                    mark,
                )
            records = {}
            for rec in read:
                if rec.attempt == spec.attempt:
                    records.setdefault(rec.seq, rec)
            if not records:
                raise ReplayDiverged(
                    f"no recorded call of session {spec.session_id} attempt {spec.attempt} "
                    "(its records expired, or it made none)",
                    mark,
                )
            self.keep(spec, records)
        return records

    def keep(self, spec: ReplaySpec, records: dict[int, CompletionRecord]) -> None:
        self._records.put((spec.session_id, spec.attempt), records)

    async def answer(
        self,
        ctx: CallContext,
        normalized: bytes,
        states: list[TurnState],
        spec: ReplaySpec,
        call: int,
    ) -> Replayed:
        """The recorded answer of the replay's call ``call`` (0, 1, ...: a replay is not
        retried), or a ``ReplayRefusal`` whose report and mark its record keeps."""
        seq = spec.seq_floor + call  # the recorded call's number
        mark = ReplayMark(session_id=spec.session_id, attempt=spec.attempt, seq=seq)
        key = (ctx.session_id, ctx.attempt)
        if (earlier := self._diverged.get(key)) is not None:
            refused = msgspec.structs.replace(mark, result=REPLAY_REFUSED)
            raise ReplayDiverged(f"this replay diverged already: {earlier}", refused)
        diverged = msgspec.structs.replace(mark, result=REPLAY_DIVERGED)
        try:
            records = await self.recorded(spec, diverged)
            rec = records.get(seq)
            prompt = _full_prompt(records, seq)
            if rec is not None and rec.void:
                failed = msgspec.structs.replace(mark, result=REPLAY_FAILED)
                raise ReplayedFailure(f"replayed failure of call {call}: {rec.error}", failed)
            if rec is None or prompt is None:
                made = sum(1 for r in records.values() if r.seq >= spec.seq_floor)
                raise ReplayDiverged(
                    f"replay of {spec.session_id} diverged at call {call}: the recorded "
                    f"attempt made {made} calls",
                    diverged,
                )
            renamed = as_recorded(normalized, ctx.session_id, spec.session_id)
            diff = request_diff(
                with_sampling(bytes(rec.normalized), bytes(rec.raw_request)),
                with_sampling(renamed, ctx.raw_request),
            )
            if diff is not None and not diff.only_nondeterministic:
                raise ReplayDiverged(
                    f"replay of {spec.session_id} diverged at call {call}: {diff.describe()}",
                    diverged,
                )
        except ReplayDiverged as exc:  # every later call of the replay is refused so too
            self._diverged.put(key, exc.report)
            raise
        explained = {n for d in diff.differences for n in d.nondeterministic} if diff else set()
        if renamed != normalized and request_diff(bytes(rec.normalized), normalized):
            explained.add("session id")  # e.g. a working directory named after it
        return Replayed(
            plan=_plan(prompt, states, rec),
            gen=_generation(rec, prompt),
            turn=_turn(rec, prompt),
            health=rec.tool_parse,
            mark=msgspec.structs.replace(
                mark, nondeterministic=sorted(explained), trainable=spec.train
            ),
        )


def _full_prompt(records: dict[int, CompletionRecord], seq: int) -> list[int] | None:
    """Call ``seq``'s whole prompt: its record and the chain of bases it is stored
    against, rebuilt by the one rebuild (``reconstruct_prompts``); None when a base is
    missing or the call failed unsampled. Rebuilt when asked, not kept: a long session's
    prompts are its calls times its context."""
    chain, at = [], records.get(seq)
    while at is not None and at not in chain[-1:]:  # a base is an earlier call
        chain.append(at)
        base = at.prompt_base_seq
        at = records.get(base) if base is not None and base < at.seq else None
    return reconstruct_prompts(chain, []).get(seq)


def task_of(session_id: str) -> str:
    """A session's task id (``schemas.session_id_for``: ``<task>-<index:04d>``)."""
    task, _, index = session_id.rpartition("-")
    return task if task and index.isdigit() else session_id


def as_recorded(normalized: bytes, session_id: str, recorded: str) -> bytes:
    """The request with the replay's own session and task ids written as the recorded
    session's: a harness's working directory and its prompts name them (a CLI writes its
    cwd into its system prompt), and the replay runs in a session of its own."""
    out = normalized.replace(session_id.encode(), recorded.encode())
    task, recorded_task = task_of(session_id), task_of(recorded)
    if task != session_id and recorded_task != recorded:
        out = out.replace(task.encode(), recorded_task.encode())
    return out


def _plan(prompt: list[int], states: list[TurnState], rec: CompletionRecord) -> PromptPlan:
    """The recorded prompt, extending the session's stored state it starts with (the
    replayed call before it), so a fork's live calls extend the replayed tokens."""
    base, shared = None, 0
    for state in states:
        sampled = state.sampled_ids()
        if len(sampled) > shared and prompt[: len(sampled)] == sampled:
            base, shared = state, len(sampled)
    extends = (base is not None) if states else None
    return PromptPlan(prompt, base, extends, None, tuple(rec.images), shared if base else None)


def _generation(rec: CompletionRecord, prompt: list[int]) -> Generation:
    finish = rec.finish_reason if rec.finish_reason in ("stop", "length", "abort") else "stop"
    return Generation(
        prompt_ids=prompt,
        output_ids=list(rec.output_ids),
        output_logprobs=list(rec.output_logprobs),
        finish_reason=finish,  # type: ignore[arg-type]
        weight_version=rec.weight_version,
        weight_versions=list(rec.weight_versions),
        weight_version_starts=list(rec.weight_version_starts),
        served_model=rec.served_model,
    )


def _turn(rec: CompletionRecord, prompt: list[int]) -> AssistantTurn:
    """The assistant turn the harness was answered with, from the record's reply."""
    reply = orjson.loads(bytes(rec.reply)) if bytes(rec.reply) != b"null" else {}
    reply = reply if isinstance(reply, dict) else {}
    calls = [
        ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in reply.get("tool_calls") or []
    ]
    finish = rec.finish_reason if rec.finish_reason in ("stop", "length", "tool_calls") else "stop"
    return AssistantTurn(
        text=reply.get("content") or "",
        reasoning=reply.get("reasoning_content") or "",
        tool_calls=calls,
        finish_reason=finish,  # type: ignore[arg-type]
        usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(rec.output_ids)),
    )
