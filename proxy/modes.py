"""The upstream modes: one object per way of calling the engine, which the completion
handler delegates to (``MODES[mode](...)``, no if-chains on the mode).

Token mode (TITO, ``TokenMode``): the proxy renders the chat template itself, extends
the session's previous prompt + sampled output token for token (``proxy.tito``), calls
the engine with ``input_ids`` and parses tool calls itself. Chat mode (``ChatMode``): the
engine templates and parses; the proxy records whether each prompt still extended the
previous call, and why not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from proxy import metrics
from proxy.backends.base import ChatRequest, Generation, RoutingAsk, SamplingParams, TokenRequest
from proxy.capture import CallContext
from proxy.conversation import AssistantTurn, ToolCall, Usage
from proxy.errors import ProtocolError
from proxy.images import ImageStore, place, place_sampled
from proxy.io.serving import after_reply
from proxy.routing import RoutingCapture, RoutingState
from proxy.tito import (
    HISTORY_POLICIES,
    KEEP_SAMPLED,
    PromptPlan,
    TurnState,
    head_text,
    judge_chat_prompt,
    pack,
    plan_token_prompt,
    unpack,
)
from schemas import UpstreamMode
from schemas.completion import ToolParse, ToolParseFailure, common_prefix_length
from schemas.routing import RoutedExperts
from services.common.tokenization import ChatTokenizer, ParsedReply, TemplateRenderError
from services.common.tokenization.lru import SizedLRU

if TYPE_CHECKING:
    from proxy.handler import _Request

log = logging.getLogger(__name__)

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
# First calls' prompts by request (its messages and tools as JSON, and the ids packed):
# ~16 MB, i.e. tens of thousands of short requests or ~100 of the longest rendered
# ahead; an entry's objects (key, value, its place in the map) count ~200 bytes more.
PROMPT_CACHE_BYTES = 16_000_000
PROMPT_ENTRY_BYTES = 200
T = TypeVar("T")


class OffLoop:
    """Runs a request's templating and tokenizing: a long request's (over
    ``PLAN_OFF_LOOP_BYTES``) in a worker thread, ``PLANS_OFF_LOOP_AT_ONCE`` at a time; a
    short one's on the event loop, where it is cheaper than the hand-off."""

    def __init__(self, at_once: int = PLANS_OFF_LOOP_AT_ONCE) -> None:
        self._heavy = asyncio.Semaphore(at_once)

    async def __call__(self, request_bytes: int, fn: Callable[..., T], *args: Any) -> T:
        if request_bytes <= PLAN_OFF_LOOP_BYTES:
            return fn(*args)
        async with self._heavy:
            return await asyncio.to_thread(fn, *args)


class TokenMode:
    """TITO: the proxy templates and tokenizes, the engine samples from ids."""

    mode = UpstreamMode.TOKEN

    def __init__(
        self,
        backend,
        tokenizer: ChatTokenizer | None,
        images: ImageStore | None = None,
        history: str = KEEP_SAMPLED,
        off_loop: OffLoop | None = None,
        routing: RoutingCapture | None = None,
    ) -> None:
        if tokenizer is None:
            raise ValueError("token mode needs the model's tokenizer (model_dir)")
        if history not in HISTORY_POLICIES:
            raise ValueError(
                f"history must be one of {', '.join(HISTORY_POLICIES)}, not {history!r}"
            )
        self.backend, self.tok, self.images, self.history = backend, tokenizer, images, history
        self.routing = routing  # MoE expert routing asked of the engine (proxy/routing.py)
        self._said_missing = False
        # the engine sees ids, so the template's end-of-turn ids stop it
        self.stop_ids = sorted(set(tokenizer.eos_token_ids))
        # each answered call's head text, rendered once the answer is out, so the call
        # that continues it renders its conversation once instead of twice
        self.heads: SizedLRU[tuple[str, int, int], str] = SizedLRU(
            HEAD_CACHE_CHARS, lambda _key, text: len(text)
        )
        self.off_loop = off_loop or OffLoop()
        # a first call's prompt by its request: the sessions of an RL group (and a
        # harness's retries) start from the same messages, so each is rendered once
        self.first_prompts: SizedLRU[bytes, bytes] = SizedLRU(
            PROMPT_CACHE_BYTES, lambda key, packed: len(key) + len(packed) + PROMPT_ENTRY_BYTES
        )
        # a template that writes today's date renders the same messages otherwise tomorrow
        self._same_render = "strftime_now" not in tokenizer.chat_template

    def render_ahead(self, request: _Request) -> None:
        """A short request without an assistant turn continues no state (continuing one
        means echoing its answer): its prompt is rendered in full while its lookup is out."""
        if len(request.raw) > RENDER_AHEAD_MAX_BYTES:
            return
        if any(m.get("role") == "assistant" for m in request.messages):
            return
        try:
            request.prompt_ids = self.first_prompt(request)
        except TemplateRenderError as exc:
            request.rejected = rejected(exc)

    def first_prompt(self, request: _Request) -> list[int]:
        """``render_ids`` of the request's messages and tools, from the cache when an
        identical request (the same normalized JSON) was rendered before."""
        render = partial(
            self.tok.render_ids, request.messages, request.tools, **request.template_kwargs
        )
        if not self._same_render or request.image_urls:  # images: the bytes are the key
            return render()
        packed = self.first_prompts.get(request.prompt_key)
        if packed is not None:
            return unpack(packed)
        ids = render()
        self.first_prompts.put(request.prompt_key, pack(ids))
        return ids

    async def generate(
        self, ctx: CallContext, request: _Request, states: list[TurnState], sampling: SamplingParams
    ) -> tuple[PromptPlan, Generation]:
        sid = ctx.session_id
        plan = await self.off_loop(len(request.raw), self.plan, request, states, sid, ctx.attempt)
        images = request.read_images()
        if images and self.images is not None:  # before the record that names them
            await self.images.put(images)
        gen = await self.backend.generate(
            TokenRequest(
                session_id=sid,
                input_ids=plan.prompt_ids,
                sampling=sampling,
                image_data=[im.base64 for im in images],
                routing=self._routing_ask(plan),
            )
        )
        return plan, gen

    def _routing_ask(self, plan: PromptPlan) -> RoutingAsk | None:
        if self.routing is None:
            return None
        base = plan.base
        return self.routing.ask(base.routing if base else None, _shared(plan))

    async def store_routing(
        self, ctx: CallContext, seq: int, plan: PromptPlan, gen: Generation
    ) -> tuple[RoutedExperts | None, RoutingState | None]:
        """The call's routing rows stored, as its record and its state name them. A store
        that fails costs the routing (logged and counted), never the call."""
        if self.routing is None:
            return None, None
        if gen.routing is None:  # an engine started without --enable-return-routed-experts
            metrics.ROUTING.labels("missing").inc()
            if not self._said_missing:  # once a process: every call would say the same
                self._said_missing = True
                log.warning(
                    "the engine (%s) answered without the routing asked of it: start it with "
                    "--enable-return-routed-experts, or turn routed_experts off; calls are "
                    'recorded without routing (polar_proxy_routing_calls_total{result="missing"})',
                    gen.worker or "?",
                )
            return None, None
        base = plan.base
        try:
            routed, state = await self.routing.store(
                ctx.session_id,
                ctx.attempt,
                seq,
                gen,
                base.seq if base else None,
                base.routing if base else None,
                _shared(plan),
            )
        except Exception as exc:  # noqa: BLE001 - any failure: the rows are not kept
            metrics.ROUTING_NOT_STORED.labels().inc()
            log.warning("routing of call %d of %s not stored: %s", seq, ctx.session_id, exc)
            return None, None
        metrics.ROUTING.labels("delta" if routed.base_seq is not None else "full").inc()
        metrics.ROUTING_ROWS.labels("returned").inc(gen.routing.rows)
        metrics.ROUTING_ROWS.labels("stored").inc(routed.rows)
        return routed, state

    def plan(
        self, request: _Request, states: list[TurnState], sid: str, attempt: int
    ) -> PromptPlan:
        if request.rejected is not None:
            raise request.rejected

        def heads(state: TurnState) -> str | None:
            return self.heads.get((sid, attempt, state.seq))

        try:
            plan = plan_token_prompt(
                self.tok,
                request.state_messages(),  # a bad image: its 400 before any rendering
                request.tools,
                states,
                request.key,
                heads,
                rendered=request.prompt_ids,
                kwargs=request.template_kwargs,
                policy=self.history,
            )
        except TemplateRenderError as exc:
            raise rejected(exc) from exc
        images = request.read_images()
        if not images:
            return plan
        if self.tok.images is None:  # its template may write a placeholder: never sent as is
            raise ProtocolError(
                400,
                "token mode cannot give this model images: its image token count is not "
                "fixed (or it has no vision tower); serve it in chat mode for images",
            )
        return dataclasses.replace(plan, images=place(plan.prompt_ids, self.tok, images))

    async def aborted_plan(
        self, request: _Request, states: list[TurnState], sid: str, attempt: int
    ) -> PromptPlan:
        """The prompt of a call the harness left before its answer (a long one planned
        off the event loop, as the call itself was)."""
        return await self.off_loop(len(request.raw), self.plan, request, states, sid, attempt)

    def turn(self, gen: Generation, tools) -> tuple[AssistantTurn, ToolParse | None]:
        """The answer, parsed here from the sampled ids by the model family's parser (tool
        calls get new ids unless the model wrote them), and its parse health."""
        parsed = self.tok.parse_reply(gen.output_ids, tools, gen.prompt_ids)
        calls = [  # the id the model wrote, where its format has one (Mistral's)
            ToolCall(id=c.id or call_id(), name=c.name, arguments=c.arguments)
            for c in parsed.tool_calls
        ]
        turn = assistant_turn(gen, parsed.content, parsed.reasoning or "", calls)
        return turn, parse_health(self.tok, parsed, tools)

    def answered(
        self, ctx: CallContext, plan: PromptPlan, state: TurnState, request: _Request
    ) -> None:
        """A long conversation's head is rendered once its answer is with the server."""
        if len(plan.prompt_ids) >= HEAD_AHEAD_MIN_TOKENS:
            key = (ctx.session_id, ctx.attempt, state.seq)
            after_reply(self._prepare_head, key, state, request.tools, request.template_kwargs)

    def _prepare_head(self, key: tuple[str, int, int], state: TurnState, tools, kwargs) -> None:
        # a template that refuses it: the continuing call renders it and reports why
        with contextlib.suppress(TemplateRenderError):
            self.heads.put(key, head_text(self.tok, state, tools, kwargs))


def _shared(plan: PromptPlan) -> int:
    """Leading ids the prompt shares with its base's prompt + output."""
    if plan.base is None:
        return 0
    if plan.shared is not None:
        return plan.shared
    return common_prefix_length(plan.prompt_ids, plan.base.sampled_ids())


class ChatMode:
    """The engine templates and parses; the proxy judges whether the prompt extended."""

    mode = UpstreamMode.CHAT
    stop_ids: list[int] = []
    routing = None  # the engine's chat endpoint: no routing captured (docs/training.md)

    def __init__(
        self,
        backend,
        tokenizer: ChatTokenizer | None,
        images: ImageStore | None = None,
        history: str = KEEP_SAMPLED,  # the engine renders the history as its template does
        off_loop: OffLoop | None = None,  # the engine plans the prompt: nothing to run
        routing: RoutingCapture | None = None,  # token mode only: refused at start
    ) -> None:
        # the tokenizer, when the proxy has one, only says where images sit in the prompt
        self.backend, self.tok, self.images = backend, tokenizer, images

    def render_ahead(self, request: _Request) -> None:
        """Nothing: the engine renders the prompt."""

    async def generate(
        self, ctx: CallContext, request: _Request, states: list[TurnState], sampling: SamplingParams
    ) -> tuple[PromptPlan, Generation]:
        messages, tools = request.messages, request.tools
        images = request.read_images()  # the engine reads them from the messages
        if images and self.images is not None:
            await self.images.put(images)
        gen = await self.backend.chat(
            ChatRequest(
                session_id=ctx.session_id,
                messages=messages,
                tools=tools,
                sampling=sampling,
                model=ctx.model,
                extra_body={"chat_template_kwargs": kwargs}
                if (kwargs := request.template_kwargs)
                else {},
            )
        )
        decode = self.tok.decode if self.tok is not None else None
        plan = judge_chat_prompt(
            gen.prompt_ids, request.state_messages(), tools, states, request.key, decode
        )
        if images:
            plan = dataclasses.replace(plan, images=place_sampled(gen.prompt_ids, self.tok, images))
        return plan, gen

    async def aborted_plan(
        self, request: _Request, states: list[TurnState], sid: str, attempt: int
    ) -> PromptPlan:
        """Nothing: the engine templates the prompt and only says what it was when done."""
        return PromptPlan([], None, None, None)

    def turn(self, gen: Generation, tools) -> tuple[AssistantTurn, ToolParse | None]:
        """The answer as the engine parsed it (its tool call ids kept); its parse health
        read by the family's parser when the proxy has the model's tokenizer."""
        calls = [
            ToolCall(id=c.id or call_id(), name=c.name, arguments=c.arguments)
            for c in gen.tool_calls
        ]
        turn = assistant_turn(gen, gen.text, gen.reasoning or "", calls)
        if self.tok is None or not tools:
            return turn, None
        parsed = self.tok.parse_reply(gen.output_ids, tools, gen.prompt_ids)
        return turn, parse_health(self.tok, parsed, tools)

    def answered(
        self, ctx: CallContext, plan: PromptPlan, state: TurnState, request: _Request
    ) -> None:
        """Nothing to prepare for the next call."""


Upstream = TokenMode | ChatMode
MODES: dict[UpstreamMode, type[TokenMode] | type[ChatMode]] = {
    UpstreamMode.TOKEN: TokenMode,
    UpstreamMode.CHAT: ChatMode,
}


def assistant_turn(gen: Generation, text: str, reasoning: str, calls: list[ToolCall]):
    """The turn the harness is answered with; a turn that calls tools finishes as such."""
    finish = gen.finish_reason
    if calls and finish == "stop":
        finish = "tool_calls"
    usage = Usage(prompt_tokens=len(gen.prompt_ids), completion_tokens=len(gen.output_ids))
    return AssistantTurn(
        text=text, reasoning=reasoning, tool_calls=calls, finish_reason=finish, usage=usage
    )


def parse_health(tok: ChatTokenizer, parsed: ParsedReply, tools) -> ToolParse | None:
    """What the record says of the output's tool markup, on a call that offered tools."""
    if not tools:
        return None
    failures = [
        ToolParseFailure(kind=f.kind, detail=f.detail, start=f.start, end=f.end)
        for f in parsed.failures
    ]
    return ToolParse(
        ok=not failures, family=tok.family.name, calls=len(parsed.tool_calls), failures=failures
    )


def rejected(exc: TemplateRenderError) -> ProtocolError:
    # e.g. image parts for a text-only template
    return ProtocolError(400, f"the model's chat template rejects this request: {exc}")


def call_id() -> str:
    return f"call_{random.getrandbits(96):024x}"  # unique, not secret: no getrandom() syscall
