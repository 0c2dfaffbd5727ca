"""The completion handler: one harness call -> engine -> CompletionRecord -> AssistantTurn.

Token mode (TITO): the proxy renders the chat template itself, extends the session's
previous prompt + sampled output token for token (``proxy.tito``), calls the engine with
``input_ids`` and parses tool calls itself. Chat mode: the engine templates and parses;
the proxy records whether each prompt still extended the previous call, and why not.
Either way the record is committed to JetStream before the turn is returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Mapping
from functools import partial
from typing import Any

from proxy import capture, metrics, sidecalls
from proxy.app import ModelCall, Render, SessionInfo, estimate_tokens
from proxy.backends.base import BackendError, ChatRequest, Generation, SamplingParams, TokenRequest
from proxy.backends.base import ErrorKind as BackendKind
from proxy.capture import CallContext, Reservation, SessionStore, decode_states
from proxy.conversation import AssistantTurn, Conversation, ToolCall, Usage
from proxy.errors import ErrorKind, ProtocolError, ProxyError, UpstreamError
from proxy.gate import WeightGate
from proxy.io.jspub import JetStreamPublisher
from proxy.io.resp import RedisReplyError, RedisUnavailable
from proxy.io.serving import after_reply
from proxy.tito import (
    PromptPlan,
    TurnState,
    head_text,
    judge_chat_prompt,
    pack,
    plan_token_prompt,
    tools_key,
)
from schemas import Protocol, UpstreamMode
from services.common.tokenization import ChatTokenizer, TemplateRenderError
from services.common.tokenization.lru import SizedLRU

log = logging.getLogger("polar.proxy")

HEAD_CACHE_CHARS = 64_000_000  # ~64 MB of rendered conversations
# Shorter conversations render in tens of µs: not worth rendering ahead for a next call
# that may never come (a long one costs ~0.5 ms per render at 20k tokens).
HEAD_AHEAD_MIN_TOKENS = 2048
# Rendering a first call's prompt while its lookup is out saves at most that round trip
# (~0.1 ms): worth it for short requests only, and a longer one is then not rendered
# before its token is known to be valid.
RENDER_AHEAD_MAX_BYTES = 64 * 1024
# A longer request is planned (templated and tokenized, seconds for megabytes) in a
# worker thread, a few at a time, so the event loop keeps serving every other session's
# calls meanwhile; a shorter one is cheaper than the hand-off to a thread.
PLAN_OFF_LOOP_BYTES = RENDER_AHEAD_MAX_BYTES
PLANS_OFF_LOOP_AT_ONCE = 2

_KIND = {
    BackendKind.CONTEXT_LENGTH: ErrorKind.CONTEXT_LENGTH,
    BackendKind.BAD_REQUEST: ErrorKind.BAD_REQUEST,
    BackendKind.OVERLOADED: ErrorKind.OVERLOADED,
}


class CompletionHandler:
    def __init__(
        self,
        *,
        publisher: JetStreamPublisher,
        store: SessionStore,
        backend,
        gate: WeightGate,
        mode: UpstreamMode,
        tokenizer: ChatTokenizer | None,
        default_max_tokens: int,
    ) -> None:
        if mode == UpstreamMode.TOKEN and tokenizer is None:
            raise ValueError("token mode needs the model's tokenizer (model_dir)")
        self.publisher, self.store, self.backend, self.gate = publisher, store, backend, gate
        self.mode, self.tok, self.default_max_tokens = mode, tokenizer, default_max_tokens
        self.stop_ids = sorted(set(tokenizer.eos_token_ids)) if mode == UpstreamMode.TOKEN else []
        # token mode: each answered call's head text, rendered once the answer is out, so
        # the call that continues it renders its conversation once instead of twice
        self.heads: SizedLRU[tuple[str, int, int], str] = SizedLRU(
            HEAD_CACHE_CHARS, lambda _key, text: len(text)
        )
        self._heavy_plans = asyncio.Semaphore(PLANS_OFF_LOOP_AT_ONCE)

    def prepare(
        self, conv: Conversation, protocol: str, raw: bytes, headers: Mapping[str, str]
    ) -> ModelCall:
        """The call's work that its request alone decides, done while its session lookup
        is under way (``proxy.app``): the OpenAI-shaped conversation, and in token mode a
        first call's prompt ids. Raises nothing: a failure is raised when the call is made."""
        request = _Request(conv, protocol, raw, headers)
        try:
            request.describe()
            request.side_call = sidecalls.classify(protocol, conv)
        except Exception as exc:  # a bug: the call fails once it is made (its number given back)
            request.broken = exc
            return partial(self._complete, request)
        messages, tools = request.messages, request.tools
        # A request without an assistant turn continues no state (continuing one means
        # echoing its answer), so it is rendered in full whatever the session holds.
        if (
            self.mode == UpstreamMode.TOKEN
            and len(raw) <= RENDER_AHEAD_MAX_BYTES
            and all(m.get("role") != "assistant" for m in messages)
        ):
            try:
                request.prompt_ids = self.tok.render_ids(messages, tools)
            except TemplateRenderError as exc:
                request.rejected = _rejected(exc)
        return partial(self._complete, request)

    async def _complete(self, request: _Request, session: SessionInfo, render: Render) -> Any:
        protocol, conv = request.protocol, request.conv
        if request.broken is not None:
            await self.unused(session, protocol, _failure(request.broken))
            raise request.broken
        tools, sid = request.tools, session.session_id
        ctx = self._context(session, protocol, request)
        states = decode_states(session.data["states"])  # as the session was when called
        reserved: Reservation | None = None
        capturing = False
        try:
            async with self.gate.call():
                queue_ms = (time.time() - ctx.received) * 1000.0  # waiting while paused
                reserved = self._number(session)
                try:
                    plan, gen = await self._generate(ctx, conv, request, states)
                except Exception as exc:  # nothing sampled: the number is given back
                    settling, reserved = reserved, None  # a hang-up now gets a new one
                    await asyncio.shield(self._settle(ctx, settling, _failure(exc)))
                    raise
                # Once sampled, a call is captured in full even if the harness leaves now.
                capturing = True
                state, reply = await asyncio.shield(
                    self._capture(ctx, reserved, plan, gen, request, queue_ms, render)
                )
        except asyncio.CancelledError:  # the harness hung up: the engine call is dropped
            if not capturing:
                await asyncio.shield(self._record_abort(ctx, reserved, request, states))
            raise
        except BackendError as exc:
            metrics.CALLS.labels(protocol, "backend_error").inc()
            raise UpstreamError(
                exc.status or 503, str(exc), _KIND.get(exc.kind, ErrorKind.UNAVAILABLE)
            ) from exc
        except (RedisUnavailable, RedisReplyError) as exc:  # session state: a 503, not a 500
            metrics.CALLS.labels(protocol, "state_error").inc()
            raise UpstreamError(503, f"session state unavailable: {exc}") from exc
        # counted as the answer goes out (the next turn of the event loop), before a
        # client that got the answer can ask /metrics
        asyncio.get_running_loop().call_soon(metrics.observe_call, protocol, ctx, gen, plan)
        if self.mode == UpstreamMode.TOKEN and len(plan.prompt_ids) >= HEAD_AHEAD_MIN_TOKENS:
            after_reply(self._prepare_head, (sid, ctx.attempt, state.seq), state, tools)
        return reply

    async def count(
        self,
        session: SessionInfo,
        conv: Conversation,
        protocol: str,
        raw: bytes,
        headers: Mapping[str, str],
    ) -> int:
        """count_tokens, answered from the model's tokenizer (else estimated) and captured
        as a side call (its prompt, nothing sampled) under the number its lookup took, so
        a trajectory lists every call the harness made."""
        request = _Request(conv, protocol, raw, headers)
        try:
            request.describe()
            request.side_call = "count_tokens"
            ids = self.tok.render_ids(request.messages, request.tools) if self.tok else []
        except Exception as exc:  # the number its lookup took is given back either way
            await self.unused(session, protocol, _failure(exc))
            if isinstance(exc, TemplateRenderError):
                raise _rejected(exc) from exc
            raise
        ctx = self._context(session, protocol, request)
        reserved = self._number(session)
        gen = Generation(prompt_ids=ids, output_ids=[], output_logprobs=[], finish_reason="stop")
        try:
            record = capture.build_record(
                ctx, await reserved, PromptPlan(ids, None, None, None), gen
            )
            await capture.commit(self.publisher, record)
        except UpstreamError:  # not captured: the harness gets the error, the number back
            await asyncio.shield(self._settle(ctx, reserved, "count_tokens not captured"))
            raise
        except (RedisUnavailable, RedisReplyError) as exc:
            raise UpstreamError(503, f"session state unavailable: {exc}") from exc
        return len(ids) if self.tok is not None else estimate_tokens(conv)

    def _prepare_head(self, key: tuple[str, int, int], state: TurnState, tools) -> None:
        # a template that refuses it: the continuing call renders it and reports why
        with contextlib.suppress(TemplateRenderError):
            self.heads.put(key, head_text(self.tok, state, tools))

    def _number(self, session: SessionInfo) -> Reservation:
        """The number the session lookup took, else one asked for now (a call in the
        grace window): it is back while the engine answers."""
        seq = session.data.get("seq")
        return Reservation.taken(seq) if seq is not None else self.store.reserve(session.session_id)

    async def unused(self, session: SessionInfo, protocol: str, reason: str) -> None:
        """The call its lookup numbered will not be made (its request was refused)."""
        seq = session.data.get("seq")
        if seq is None:
            return
        ctx = self._context(session, protocol, None)
        await asyncio.shield(self._settle(ctx, Reservation.taken(seq), reason))

    def _context(self, session: SessionInfo, protocol: str, request: _Request | None):
        """The call as its record describes it (``request`` None: a call never made)."""
        return CallContext(
            session_id=session.session_id,
            attempt=session.data["attempt"],
            protocol=Protocol(protocol),
            mode=self.mode,
            model=(request.conv.model or session.model) if request else "",
            raw_request=request.raw if request else b"",
            normalized=request.normalized if request else b"null",
            user_agent=request.headers.get("user-agent") if request else None,
            side_call=request.side_call if request else None,
            received=time.time(),
        )

    async def _capture(
        self, ctx, reserved, plan, gen, request: _Request, queue_ms, render: Render
    ) -> tuple[TurnState, Any]:
        """Commit the call's record and store its TITO state, both round trips at once,
        the answer rendered (``render``) while they are out (parsed before: the record
        carries the turn's finish reason and message). A failed commit is the caller's error (the state is taken back and the number given back, so the
        retry re-extends the old state). A state that could not be stored after a
        committed record only costs the next call its extension."""
        seq = await reserved
        turn, failed, message = None, None, None
        try:  # first: the record carries the turn's finish reason (tool_calls in either
            # mode) and the answer itself (a trainer's conversation ends with it)
            turn = self._turn(gen, request.tools)
            message = _reply_message(turn)
        except Exception as exc:  # a bug: recorded all the same, then the harness's 500
            failed = exc
        finish = turn.finish_reason if turn is not None else None
        record = capture.build_record(
            ctx, seq, plan, gen, queue_ms=queue_ms, finish=finish, reply=message
        )
        committing = capture.start_commit(self.publisher, record)  # the longer wait: first
        try:
            if failed is not None:
                raise failed
            state = TurnState(
                seq=seq,
                messages=request.messages,
                reply=message,
                tools_key=request.key,
                prompt=pack(plan.prompt_ids),
                output=pack(gen.output_ids),
            )
            stored, remembering = self.store.remember(ctx.session_id, ctx.attempt, state)
            reply = render(turn)
        except Exception:  # a bug: the record is out all the same, and the harness gets a 500
            with contextlib.suppress(UpstreamError):
                await committing
            raise
        try:
            await committing
        except UpstreamError:
            metrics.CAPTURE_FAILURES.labels(ctx.protocol.value).inc()
            # not stored, or Redis is gone: then the state is gone with it
            with contextlib.suppress(RedisUnavailable, RedisReplyError):
                await remembering
                await self.store.forget(ctx.session_id, ctx.attempt, stored)
            await self._settle(ctx, reserved, "capture failed", void=False)
            raise
        try:
            await remembering
        except (RedisUnavailable, RedisReplyError) as exc:
            metrics.STATE_WRITE_FAILURES.labels(ctx.protocol.value).inc()
            log.warning(
                "call %d of %s captured, its state not stored: %s", seq, ctx.session_id, exc
            )
        return state, reply

    async def _settle(
        self, ctx: CallContext, reserved: Reservation, reason: str, *, void: bool = True
    ) -> None:
        """A number whose call will have no record: given back if no later call took one,
        else filled with a void record (``void``) so builders see no lost call."""
        try:
            seq = await reserved
        except (RedisUnavailable, RedisReplyError):
            return  # no number was taken
        try:
            if await self.store.release_seq(ctx.session_id, seq) or not void:
                return
            await capture.commit(self.publisher, capture.void_record(ctx, seq, reason))
        except (ProxyError, RedisUnavailable, RedisReplyError) as exc:
            log.warning("call %d of %s left a gap (%s): %s", seq, ctx.session_id, reason, exc)

    async def _record_abort(self, ctx: CallContext, reserved, request: _Request, states) -> None:
        """The harness left before an answer: record the call, aborted, with its prompt."""
        metrics.CALLS.labels(ctx.protocol.value, "aborted").inc()
        try:
            if self.mode == UpstreamMode.TOKEN:
                plan = self._plan(request, states, ctx.session_id, ctx.attempt)
            else:  # the engine templates the prompt and only says what it was when done
                plan = PromptPlan([], None, None, None)
            empty = Generation(
                prompt_ids=plan.prompt_ids, output_ids=[], output_logprobs=[], finish_reason="abort"
            )
            if reserved is None:  # it left while waiting at the gate
                reserved = self.store.reserve(ctx.session_id)
            record = capture.build_record(ctx, await reserved, plan, empty, aborted=True)
            try:
                await capture.commit(self.publisher, record)
            except UpstreamError:
                await self._settle(ctx, reserved, "aborted call not captured", void=False)
                raise
        except (ProxyError, RedisUnavailable, RedisReplyError) as exc:
            log.warning("could not record an aborted call of %s: %s", ctx.session_id, exc)

    async def _generate(self, ctx: CallContext, conv, request: _Request, states):
        sid, messages, tools = ctx.session_id, request.messages, request.tools
        sampling = self._sampling(conv)
        if self.mode == UpstreamMode.TOKEN:
            if len(request.raw) > PLAN_OFF_LOOP_BYTES:
                async with self._heavy_plans:
                    plan = await asyncio.to_thread(self._plan, request, states, sid, ctx.attempt)
            else:
                plan = self._plan(request, states, sid, ctx.attempt)
            gen = await self.backend.generate(
                TokenRequest(session_id=sid, input_ids=plan.prompt_ids, sampling=sampling)
            )
            return plan, gen
        gen = await self.backend.chat(
            ChatRequest(
                session_id=sid,
                messages=messages,
                tools=tools,
                sampling=sampling,
                model=ctx.model,
            )
        )
        return judge_chat_prompt(gen.prompt_ids, messages, tools, states, request.key), gen

    def _plan(self, request: _Request, states, sid: str, attempt: int) -> PromptPlan:
        if request.rejected is not None:
            raise request.rejected

        def heads(state: TurnState) -> str | None:
            return self.heads.get((sid, attempt, state.seq))

        try:
            return plan_token_prompt(
                self.tok,
                request.messages,
                request.tools,
                states,
                request.key,
                heads,
                rendered=request.prompt_ids,
            )
        except TemplateRenderError as exc:
            raise _rejected(exc) from exc

    def _sampling(self, conv: Conversation) -> SamplingParams:
        s = conv.sampling
        return SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            stop=list(s.stop or []),
            max_new_tokens=s.max_tokens or self.default_max_tokens,
            # token mode: the engine sees ids, so the template's end-of-turn ids stop it
            stop_token_ids=self.stop_ids,
        )

    def _turn(self, gen: Generation, tools) -> AssistantTurn:
        if self.mode == UpstreamMode.TOKEN:
            parsed = self.tok.parse_reply(gen.output_ids, tools)
            text, reasoning = parsed.content, parsed.reasoning or ""
            calls = [
                ToolCall(id=_call_id(), name=c.name, arguments=c.arguments)
                for c in parsed.tool_calls
            ]
        else:
            text, reasoning = gen.text, gen.reasoning or ""
            calls = [
                ToolCall(id=c.id or _call_id(), name=c.name, arguments=c.arguments)
                for c in gen.tool_calls
            ]
        finish = gen.finish_reason
        if calls and finish == "stop":
            finish = "tool_calls"
        usage = Usage(prompt_tokens=len(gen.prompt_ids), completion_tokens=len(gen.output_ids))
        return AssistantTurn(
            text=text, reasoning=reasoning, tool_calls=calls, finish_reason=finish, usage=usage
        )


class _Request:
    """A call's request and what ``prepare`` made of it."""

    __slots__ = (
        "conv", "protocol", "raw", "headers", "messages", "tools", "key", "normalized",
        "side_call", "prompt_ids", "rejected", "broken",
    )  # fmt: skip

    def __init__(
        self, conv: Conversation, protocol: str, raw: bytes, headers: Mapping[str, str]
    ) -> None:
        self.conv, self.protocol, self.raw, self.headers = conv, protocol, raw, headers
        self.messages: list[dict] = []
        self.tools: list[dict] | None = None
        self.key = self.side_call = None
        self.normalized = b"null"
        self.prompt_ids: list[int] | None = None  # token mode: rendered in full ahead
        self.rejected: ProtocolError | None = None  # the chat template refused it
        self.broken: Exception | None = None  # converting it failed (a bug)

    def describe(self) -> None:
        """What the call's record and prompt are made from (raises on a converter bug)."""
        self.messages = self.conv.to_openai_messages()
        self.tools = self.conv.to_openai_tools() or None
        self.key = tools_key(self.tools)
        self.normalized = capture.normalized_json(self.messages, self.tools)


def _rejected(exc: TemplateRenderError) -> ProtocolError:
    # e.g. image parts for a text-only template
    return ProtocolError(400, f"the model's chat template rejects this request: {exc}")


def _failure(exc: Exception) -> str:
    """What a void record says about a call that failed before sampling."""
    return f"{type(exc).__name__}: {exc}"[:500]


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _reply_message(turn: AssistantTurn) -> dict:
    """The assistant message as this proxy answered (what the next request should echo)."""
    msg: dict = {"role": "assistant", "content": turn.text}
    if turn.reasoning:
        msg["reasoning_content"] = turn.reasoning
    if turn.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in turn.tool_calls
        ]
    return msg
