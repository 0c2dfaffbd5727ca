"""One huge prompt does not stall other sessions (issue 17, point 8).

The token-mode completion handler (real tokenizer, real Redis and JetStream) with an
engine that answers at once: a small call's latency is measured alone, then while
another session's multi-megabyte prompt is being templated and tokenized. That planning
runs in a worker thread (``PLAN_OFF_LOOP_BYTES``), so the small call does not wait for
it: before, it waited the whole time (a 10 MB request: 12.7 s for a 4-token call).
"""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from proxy.backends.base import Generation, TokenRequest
from proxy.conversation import Conversation, Message, TextPart
from services.common.tokenization import ChatTokenizer
from tests.helpers.stack import new_session
from tests.integration.test_proxy_numbering import as_is, handler_on
from tests.unit.engine.tiny import tiny_model_dir

pytestmark = pytest.mark.asyncio
HUGE_CHARS = 500_000  # 1 MB: over a second to plan even on a quiet machine


class InstantEngine:
    """Token mode: answers every request at once (the engine is not what is measured)."""

    async def generate(self, req: TokenRequest) -> Generation:
        return Generation(
            prompt_ids=req.input_ids, output_ids=[7, 8], output_logprobs=[-0.5, -0.25],
            finish_reason="stop", text="ok",
        )  # fmt: skip


def conversation(user_text: str) -> tuple[Conversation, bytes]:
    # an assistant turn: a call that continues a conversation (planned when it is made)
    messages = [
        Message(role="user", content=[TextPart("start")]),
        Message(role="assistant", content=[TextPart("ok")]),
        Message(role="user", content=[TextPart(user_text)]),
    ]
    raw = orjson.dumps(
        {"messages": [{"role": m.role, "content": m.content[0].text} for m in messages]}
    )
    return Conversation(model="m", messages=messages), raw


async def timed_call(handler, resolver, token: str, text: str) -> float:
    conv, raw = conversation(text)
    t0 = time.perf_counter()
    session = await resolver(token, True)
    await handler.prepare(conv, "openai_chat", raw, {})(session, as_is)
    return time.perf_counter() - t0


async def test_a_small_call_is_not_stalled_by_a_concurrent_huge_prompt(
    nats_url, redis_url, bus, redis_client
):
    tokenizer = ChatTokenizer.load(tiny_model_dir())
    async with handler_on(nats_url, redis_url, bus, tokenizer) as (handler, _, resolver):
        handler.upstream.backend = InstantEngine()
        small, big = (
            await new_session(redis_client, "huge-small"),
            await new_session(redis_client, "huge-big"),
        )
        await timed_call(handler, resolver, small.token, "warm up")
        alone = sorted([await timed_call(handler, resolver, small.token, "hi") for _ in range(5)])
        stop, during = asyncio.Event(), []

        async def small_calls() -> None:  # one after another, all through the huge call
            while not stop.is_set():
                during.append(await timed_call(handler, resolver, small.token, "hi"))
                await asyncio.sleep(0.01)

        async def ticker() -> float:  # the longest the event loop served nobody
            last, stall = time.perf_counter(), 0.0
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                stall, last = max(stall, now - last), now
            return stall

        runner, ticks = asyncio.create_task(small_calls()), asyncio.create_task(ticker())
        await asyncio.sleep(0.1)
        huge_s = await timed_call(handler, resolver, big.token, "x " * HUGE_CHARS)
        stop.set()
        await runner
        stall, worst = await ticks, max(during)
        print(
            f"\nsmall call alone: median {alone[2] * 1000:.1f} ms; during a "
            f"{HUGE_CHARS * 2 / 1e3:.0f} KB prompt planned in {huge_s:.2f} s: "
            f"{len(during)} small calls, worst {worst * 1000:.1f} ms; "
            f"longest event-loop stall {stall * 1000:.0f} ms"
        )
        assert huge_s > 1.0, huge_s  # long enough to have stalled everything before
        # before the fix: the loop stalled for the whole huge plan (~huge_s), and a small
        # call could be served only before or after it
        assert stall < huge_s / 4, (stall, huge_s)
        assert len(during) >= 5 and worst < max(0.25, 20 * alone[2]), (worst, during)
