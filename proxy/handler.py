"""The completion handler: one harness call -> engine -> CompletionRecord -> AssistantTurn.

How the engine is called (token mode: the proxy templates; chat mode: the engine does)
is the upstream mode's object (``proxy.modes``); a call's number and its life (commit,
give back, void) is ``proxy.capture.CallNumber``. Either way the record is committed to
JetStream before the turn is returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

from proxy import capture, metrics, sidecalls
from proxy.app import ModelCall, Render, SessionInfo, estimate_tokens
from proxy.backends.base import BackendError, Generation, SamplingParams
from proxy.backends.base import ErrorKind as BackendKind
from proxy.capture import (
    CallContext,
    CallNumber,
    Numbering,
    SessionStore,
    superseded,
)
from proxy.conversation import AssistantTurn, Conversation
from proxy.errors import ErrorKind, ProtocolError, ProxyError, UpstreamError
from proxy.gate import WeightGate
from proxy.images import (
    ImageStore,
    PromptImage,
    images_by_digest,
    messages_by_digest,
    read_images,
)
from proxy.io.resp import RedisReplyError, RedisUnavailable
from proxy.io.serving import serving_loop
from proxy.memory import MemoryGiveBack
from proxy.modes import MODES, OffLoop, rejected
from proxy.promptbound import PromptBound
from proxy.replay import Replayed, ReplayRefusal, Replays
from proxy.routing import RoutingCapture
from proxy.tito import KEEP_SAMPLED, PromptPlan, TurnState, pack, tools_key
from schemas import Protocol, UpstreamMode
from services.common.jspub import DuplicateMessage, JetStreamPublisher
from services.common.tokenization import ChatTokenizer, TemplateRenderError
from services.common.tokenization.families import ModelFamily
from services.common.tokenization.images import image_urls

log = logging.getLogger("polar.proxy")

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
        images: ImageStore | None = None,
        history: str = KEEP_SAMPLED,
        context_tokens: int | None = None,
        memory: MemoryGiveBack | None = None,
        routing: RoutingCapture | None = None,
        replays: Replays | None = None,
    ) -> None:
        self.off_loop = OffLoop()
        self.replays = replays  # answers a replay's calls from the record (proxy/replay.py)
        self.upstream = MODES[mode](
            backend, tokenizer, images, history, self.off_loop, routing=routing
        )
        # a prompt whose text cannot fit ``context_tokens`` is refused before templating
        self.bound = PromptBound.of(tokenizer, context_tokens)
        self.memory = memory or MemoryGiveBack()
        self.publisher, self.store, self.gate = publisher, store, gate
        self.mode, self.tok, self.default_max_tokens = mode, tokenizer, default_max_tokens
        self.numbers = Numbering(store, publisher)
        self.family = tokenizer.family if tokenizer is not None else None

    def prepare(
        self, conv: Conversation, protocol: str, raw: bytes, headers: Mapping[str, str]
    ) -> ModelCall:
        """The call's work that its request alone decides, done while its session lookup
        is under way (``proxy.app``): the OpenAI-shaped conversation, and what the mode
        renders ahead (token mode: a short first call's prompt ids). Raises nothing: a
        failure is raised when the call is made."""
        request = _Request(conv, protocol, raw, headers)
        if self.bound is not None:  # refused as it is made: nothing converted or rendered
            request.broken = self.bound.refusal(conv)
            if request.broken is not None:
                return partial(self._complete, request)
        try:
            request.describe(self.family)
            request.side_call = sidecalls.classify(protocol, conv)
        except Exception as exc:  # a bug: the call fails once it is made (its number given back)
            request.broken = exc
            return partial(self._complete, request)
        self.upstream.render_ahead(request)
        return partial(self._complete, request)

    async def _complete(self, request: _Request, session: SessionInfo, render: Render) -> Any:
        try:
            return await self._call(request, session, render)
        finally:  # a large request's memory is given back once it is gone
            self.memory.after(len(request.raw))

    async def _call(self, request: _Request, session: SessionInfo, render: Render) -> Any:
        protocol, conv = request.protocol, request.conv
        if request.broken is not None:  # a converter's bug, or a prompt that cannot fit
            await self.unused(session, protocol, _failure(request.broken))
            raise request.broken
        ctx = self._context(session, protocol, request)
        # as the session was when called
        states = self.store.states(session.session_id, session.attempt, session.states)
        number: CallNumber | None = None
        capturing = False
        loop = serving_loop()  # not asyncio's: each ask is a getpid() syscall on 3.11
        try:
            async with self.gate.call():
                queue_ms = (time.time() - ctx.received) * 1000.0  # waiting while paused
                number = self.numbers.of(session.session_id, session.seq)
                try:
                    plan, gen, replayed = await self._generate(
                        ctx, request, states, conv, session, number
                    )
                except ReplayRefusal:  # its report is the call's record: the number is used
                    number = None
                    raise
                except Exception as exc:  # nothing sampled: the number is given back
                    settling, number = number, None  # a hang-up now gets a new one
                    await asyncio.shield(loop.create_task(settling.settle(ctx, _failure(exc))))
                    raise
                # Once sampled, a call is captured in full even if the harness leaves now.
                capturing = True
                state, reply = await asyncio.shield(
                    loop.create_task(
                        self._capture(
                            ctx, number, plan, gen, request, queue_ms, render, session, replayed
                        )
                    )
                )
        except asyncio.CancelledError:  # the harness hung up: the engine call is dropped
            if not capturing:
                await asyncio.shield(
                    loop.create_task(self._record_abort(ctx, number, request, states))
                )
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
        loop.call_soon(metrics.observe_call, protocol, ctx, gen, plan)
        self.upstream.answered(ctx, plan, state, request)
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
        try:
            return await self._count(session, conv, protocol, raw, headers)
        finally:
            self.memory.after(len(raw))

    async def _count(
        self,
        session: SessionInfo,
        conv: Conversation,
        protocol: str,
        raw: bytes,
        headers: Mapping[str, str],
    ) -> int:
        request = _Request(conv, protocol, raw, headers)
        try:
            if self.bound is not None and (too_long := self.bound.refusal(conv)):
                raise too_long
            request.describe(self.family)
            request.side_call = "count_tokens"
            ids = await self.off_loop(len(raw), self._count_ids, request) if self.tok else []
        except Exception as exc:  # the number its lookup took is given back either way
            await self.unused(session, protocol, _failure(exc))
            if isinstance(exc, TemplateRenderError):
                raise rejected(exc) from exc
            raise
        ctx = self._context(session, protocol, request)
        number = self.numbers.of(session.session_id, session.seq)
        gen = Generation(prompt_ids=ids, output_ids=[], output_logprobs=[], finish_reason="stop")
        try:
            record = capture.build_record(ctx, await number, PromptPlan(ids, None, None, None), gen)
            await number.commit(record)
        except UpstreamError:  # not captured: the harness gets the error, the number back
            await asyncio.shield(number.settle(ctx, "count_tokens not captured"))
            raise
        except (RedisUnavailable, RedisReplyError) as exc:
            raise UpstreamError(503, f"session state unavailable: {exc}") from exc
        return len(ids) if self.tok is not None else estimate_tokens(conv)

    def _count_ids(self, request: _Request) -> list[int]:
        assert self.tok is not None
        return self.tok.render_ids(request.messages, request.tools, **request.template_kwargs)

    async def unused(self, session: SessionInfo, protocol: str, reason: str) -> None:
        """The call its lookup numbered will not be made (its request was refused)."""
        if session.seq is None:
            return
        ctx = self._context(session, protocol, None)
        await asyncio.shield(self.numbers.taken(session.seq).settle(ctx, reason))

    def _context(self, session: SessionInfo, protocol: str, request: _Request | None):
        """The call as its record describes it (``request`` None: a call never made)."""
        return CallContext(
            session_id=session.session_id,
            attempt=session.attempt,
            protocol=Protocol(protocol),
            mode=self.mode,
            model=(request.conv.model or session.model) if request else "",
            raw_request=request.recorded_raw() if request else b"",
            normalized=request.recorded_normalized() if request else b"null",
            user_agent=request.headers.get("user-agent") if request else None,
            side_call=request.side_call if request else None,
            received=time.time(),
        )

    async def _generate(
        self,
        ctx: CallContext,
        request: _Request,
        states: list[TurnState],
        conv: Conversation,
        session: SessionInfo,
        number: CallNumber,
    ) -> tuple[PromptPlan, Generation, Replayed | None]:
        """The engine's answer, or a replay's: the recorded call's (proxy/replay.py). A
        replay that diverges records the report as the call's failure, then raises it."""
        if session.replay and self.replays is not None:
            spec = self.replays.spec(session.replay)
            seq = await number
            if spec.until is None or seq < spec.until:
                try:
                    replayed = await self.replays.answer(
                        ctx, request.recorded_normalized(), states, spec, seq
                    )
                except ReplayRefusal as exc:
                    metrics.CALLS.labels(ctx.protocol.value, f"replay_{exc.mark.result}").inc()
                    await number.commit(capture.void_record(ctx, seq, exc.report, exc.mark))
                    raise
                return replayed.plan, replayed.gen, replayed
        plan, gen = await self.upstream.generate(ctx, request, states, self._sampling(conv))
        return plan, gen, None

    async def _capture(
        self,
        ctx,
        number: CallNumber,
        plan,
        gen,
        request: _Request,
        queue_ms,
        render: Render,
        session: SessionInfo,
        replayed: Replayed | None = None,
    ) -> tuple[TurnState, Any]:
        """Commit the call's record and store its TITO state, both round trips at once,
        the answer rendered (``render``) while they are out (parsed before: the record
        carries the turn's finish reason and message). A failed commit is the caller's
        error (the state is taken back and the number given back, so the retry
        re-extends the old state). A state that could not be stored after a committed
        record only costs the next call its extension."""
        seq = await number
        turn, failed, message, health = None, None, None, None
        try:  # first: the record carries the turn's finish reason (tool_calls in either
            # mode) and the answer itself (a trainer's conversation ends with it)
            if replayed is not None:  # what the harness was told, its tool call ids too
                turn, health = replayed.turn, replayed.health
            else:
                turn, health = self.upstream.turn(gen, request.tools)
            message = _reply_message(turn)
        except Exception as exc:  # a bug: recorded all the same, then the harness's 500
            failed = exc
        finish = turn.finish_reason if turn is not None else None
        routed, routing_state = None, None
        if self.upstream.routing is not None and replayed is None:  # MoE, routing asked
            routed, routing_state = await self.upstream.store_routing(ctx, seq, plan, gen)
        record = capture.build_record(
            ctx,
            seq,
            plan,
            gen,
            queue_ms=queue_ms,
            finish=finish,
            reply=message,
            tool_parse=health,
            routing=routed,
            replay=replayed.mark if replayed is not None else None,
        )
        committing = number.start_commit(record)  # the longer wait: first
        try:
            if failed is not None:
                raise failed
            state = TurnState(
                seq=seq,
                messages=request.state_messages(),
                reply=message,
                tools_key=request.key,
                prompt=plan.packed_prompt(),
                output=pack(gen.output_ids),
                base=plan.base.seq if plan.base is not None else None,
                routing=routing_state,
            )
            drop = superseded(session.states, plan.base)
            stored, remembering = self.store.remember(ctx.session_id, ctx.attempt, state, drop)
            reply = render(turn)
        except Exception:  # a bug: the record is out all the same, and the harness gets a 500
            with contextlib.suppress(UpstreamError):
                await committing
            raise
        try:
            await committing
        except UpstreamError as err:
            metrics.CAPTURE_FAILURES.labels(ctx.protocol.value).inc()
            # not stored, or Redis is gone: then the state is gone with it
            with contextlib.suppress(RedisUnavailable, RedisReplyError):
                await remembering
                await self.store.forget(ctx.session_id, ctx.attempt, stored)
            # a number an earlier call's record has stays taken: the next call moves on
            if not isinstance(err.__cause__, DuplicateMessage):
                await number.settle(ctx, "capture failed", void=False)
            raise
        try:
            await remembering
        except (RedisUnavailable, RedisReplyError) as exc:
            metrics.STATE_WRITE_FAILURES.labels(ctx.protocol.value).inc()
            log.warning(
                "call %d of %s captured, its state not stored: %s", seq, ctx.session_id, exc
            )
        return state, reply

    async def _record_abort(
        self, ctx: CallContext, number: CallNumber | None, request: _Request, states
    ) -> None:
        """The harness left before an answer: record the call, aborted, with its prompt."""
        metrics.CALLS.labels(ctx.protocol.value, "aborted").inc()
        try:
            plan = await self.upstream.aborted_plan(request, states, ctx.session_id, ctx.attempt)
            empty = Generation(
                prompt_ids=plan.prompt_ids, output_ids=[], output_logprobs=[], finish_reason="abort"
            )
            if number is None:  # it left while waiting at the gate
                number = self.numbers.reserve(ctx.session_id)
            record = capture.build_record(ctx, await number, plan, empty, aborted=True)
            try:
                await number.commit(record)
            except UpstreamError:
                await number.settle(ctx, "aborted call not captured", void=False)
                raise
        except (ProxyError, RedisUnavailable, RedisReplyError) as exc:
            log.warning("could not record an aborted call of %s: %s", ctx.session_id, exc)

    def _sampling(self, conv: Conversation) -> SamplingParams:
        s = conv.sampling
        return SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            stop=list(s.stop or []),
            max_new_tokens=s.max_tokens or self.default_max_tokens,
            # token mode: the engine sees ids, so the template's end-of-turn ids stop it
            stop_token_ids=self.upstream.stop_ids,
        )


class _Request:
    """A call's request and what ``prepare`` made of it."""

    __slots__ = (
        "conv", "protocol", "raw", "headers", "messages", "tools", "key", "normalized",
        "side_call", "prompt_ids", "rejected", "broken", "image_urls", "_images", "_by_digest",
        "template_kwargs", "prompt_key",
    )  # fmt: skip

    def __init__(
        self, conv: Conversation, protocol: str, raw: bytes, headers: Mapping[str, str]
    ) -> None:
        self.conv, self.protocol, self.raw, self.headers = conv, protocol, raw, headers
        self.messages: list[dict] = []
        self.tools: list[dict] | None = None
        self.key = self.side_call = None
        self.normalized = b"null"
        self.template_kwargs: dict = {}  # chat-template variables (enable_thinking, ...)
        self.prompt_key = b""  # what decides a first call's prompt: messages, tools, variables
        self.prompt_ids: list[int] | None = None  # token mode: rendered in full ahead
        self.rejected: ProtocolError | None = None  # the chat template refused it
        # converting it failed (a bug), or its prompt cannot fit (``PromptTooLong``)
        self.broken: Exception | None = None
        self.image_urls: list[str] = []
        self._images: list[PromptImage] | None = None
        self._by_digest: list[dict] | None = None

    def describe(self, family: ModelFamily | None = None) -> None:
        """What the call's record and prompt are made from (raises on a converter bug).
        ``family``: the served model's, which says how the protocol's reasoning settings
        reach its template (none known: only what the client named)."""
        conv = self.conv
        self.messages = conv.to_openai_messages()
        self.tools = conv.to_openai_tools() or None
        if family is not None:
            self.template_kwargs = family.template_kwargs(conv.reasoning, conv.template_kwargs)
        else:
            self.template_kwargs = dict(conv.template_kwargs)
        self.key = tools_key(self.tools, self.template_kwargs)
        self.normalized = capture.normalized_json(self.messages, self.tools)
        self.prompt_key = (
            self.normalized + self.key.encode() if self.template_kwargs else self.normalized
        )
        self.image_urls = image_urls(self.messages)

    def read_images(self) -> list[PromptImage]:
        """The request's images, decoded once (a 400 for one that is not inline data)."""
        if self._images is None:
            self._images = read_images(self.image_urls)
        return self._images

    def _readable_images(self) -> list[PromptImage]:
        try:
            return self.read_images()
        except ProtocolError:  # the call is refused: its void record keeps what it got
            return []

    def recorded_raw(self) -> bytes:
        """The request body as its record keeps it: images by digest, not bytes."""
        return images_by_digest(self.raw, self._readable_images()) if self.image_urls else self.raw

    def recorded_normalized(self) -> bytes:
        if not self.image_urls or not self._readable_images():
            return self.normalized
        return capture.normalized_json(self.state_messages(), self.tools)

    def state_messages(self) -> list[dict]:
        """The messages as TITO states keep and compare them: images by digest (they
        render to the same placeholder; the bytes would be stored in every state).
        Raises ProtocolError for an image that is not inline data."""
        if not self.image_urls:
            return self.messages
        if self._by_digest is None:
            self._by_digest = messages_by_digest(self.messages, self.read_images())
        return self._by_digest


def _failure(exc: Exception) -> str:
    """What a void record says about a call that failed before sampling."""
    return f"{type(exc).__name__}: {exc}"[:500]


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
