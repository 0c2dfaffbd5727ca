"""The proxy service's operations and capture guarantees, on real processes.

* Capture failure: with the completions stream gone, every protocol's call is an error
  (503, nothing answered), counted in /metrics; recreated, calls are captured again and
  the call numbers have no gap.
* Large records: a 200k-token record goes through the object-store claim-check and
  reconstructs exactly; through the proxy, a long prompt is stored once and later calls
  only store their tail.
* Metrics per protocol (calls, latency, tokens in/out, breaks by reason, side calls).
* Side calls tagged in the records; count_tokens answered with the real tokenizer.
* Pause/resume (new calls wait, in-flight ones drain) and a weight update (records
  before carry the old version, records after the new one, whose logprobs are the new
  checkpoint's).
"""

from __future__ import annotations

import asyncio
import random

import anthropic
import httpx
import msgspec
import openai
import orjson
import pytest
import redis.asyncio as aioredis
from google import genai
from google.genai import errors as genai_errors
from google.genai import types as gt

from proxy.backends.base import Generation
from proxy.capture import CallContext, build_record, commit
from proxy.tito import PromptPlan, TurnState, pack
from schemas import CompletionRecord, Protocol, UpstreamMode, decode, encode
from schemas import subjects as S
from schemas.completion import reconstruct_prompts
from services.common.bus import CLAIM_HEADER, Bus, ensure_streams
from services.common.tokenization import ChatTokenizer
from services.engine.weights import load_model
from tests.helpers.node import wait_until
from tests.helpers.prometheus import metric
from tests.helpers.stack import (
    new_session,
    proxy_process,
    start_proxy,
)
from tests.integration.proxy_agents import (
    AnthropicAgent,
    ChatAgent,
    GeminiAgent,
    ResponsesAgent,
    captured,
    run_loop,
)
from tests.unit.engine.tiny import second_checkpoint, tiny_model_dir

pytestmark = pytest.mark.asyncio
ADMIN = {"authorization": "Bearer ops-admin"}
SLOW = [{"role": "user", "content": "SLOW REPLY please"}]


@pytest.fixture(scope="module")
def proxy(engine, nats_url, redis_url, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("p")
    with proxy_process(nats_url, redis_url, engine, log_dir, admin_token="ops-admin") as p:
        yield p


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.load(tiny_model_dir())


async def get(url: str, **kw) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.get(url, **kw)


async def post(url: str, **kw) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as c:
        return await c.post(url, **kw)


async def wait_in_flight(url: str, n: int = 1) -> None:
    """Wait until the proxy has ``n`` calls admitted past its pause gate (no fixed sleep:
    how long a call takes to get there depends on the machine's load)."""
    for _ in range(600):
        if metric((await get(url + "/metrics")).text, "polar_proxy_inflight_calls") >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the call never reached the engine")


async def paused(url: str) -> bool:
    """Whether the proxy holds new calls for a weight update (it says so once the calls
    in flight have drained, and until the new weights are in)."""
    return metric((await get(url + "/metrics")).text, "polar_proxy_paused") == 1


# -- capture failure ---------------------------------------------------------------------
async def test_when_capture_fails_the_harness_gets_an_error_not_the_answer(
    engine, fresh_servers, tmp_path
):
    nats_url, redis_url = fresh_servers
    p = start_proxy(
        nats_url, redis_url, engine.url, tiny_model_dir(), tmp_path, keepalive_seconds=10
    )
    bus, rc = await Bus.open(nats_url, "test-capfail"), aioredis.from_url(redis_url)
    try:
        sessions = [await new_session(rc, f"capfail-{i}") for i in range(4)]
        agents = [
            cls(p.url, s.token)
            for cls, s in zip(
                (ChatAgent, ResponsesAgent, AnthropicAgent, GeminiAgent), sessions, strict=True
            )
        ]
        await run_loop(agents[0], 1)  # one call captured before the stream goes away
        await bus.js.delete_stream(S.STREAM_COMPLETIONS)
        statuses = {}
        for agent in agents:
            for stream in (False, True):
                with pytest.raises(Exception) as caught:  # noqa: PT011 - each SDK its own
                    await agent.step(stream=stream)
                statuses[(agent.protocol, stream)] = _status(caught.value)
        assert set(statuses.values()) == {503}, statuses
        # a count_tokens call is captured too: not captured, it is the harness's error
        # (Anthropic's shape), and its number goes back (the chain below has no gap)
        claude = anthropic.AsyncAnthropic(
            base_url=f"{p.url}/s/{sessions[0].token}", api_key="x", max_retries=0
        )
        with pytest.raises(anthropic.APIStatusError) as count_failed:
            await claude.messages.count_tokens(
                model="m", messages=[{"role": "user", "content": "count me"}]
            )
        assert count_failed.value.status_code == 503
        assert count_failed.value.body["type"] == "error"
        text = (await get(p.url + "/metrics")).text
        for agent in agents:
            assert metric(text, "polar_proxy_capture_failures_total", protocol=agent.protocol) == 2
        await ensure_streams(bus.js)  # the operator repairs the bus; the harness retries
        step = await agents[0].step(stream=False)
        assert step.call is not None
        (rec,) = await captured(bus, sessions[0].session_id, expect=1)
        assert rec.seq == 1 and rec.extends_previous is True  # no gap, the chain goes on
    finally:
        p.stop()
        await bus.close()
        await rc.aclose()


def _status(exc: BaseException) -> int | None:
    if isinstance(exc, openai.APIStatusError | anthropic.APIStatusError):
        return exc.status_code
    if isinstance(exc, genai_errors.APIError):
        return exc.code
    raise exc


# -- large records ---------------------------------------------------------------------
def _ctx(raw: bytes) -> CallContext:
    return CallContext(
        session_id="big-0000",
        attempt=0,
        protocol=Protocol.ANTHROPIC_MESSAGES,
        mode=UpstreamMode.TOKEN,
        model="m",
        raw_request=raw,
        normalized=raw,
        user_agent="claude-cli/2.1.300",
        side_call=None,
        received=0.0,
    )


def _gen(prompt: list[int], output: list[int]) -> Generation:
    logprobs = [-((i % 97) / 31.0) for i in range(len(output))]
    return Generation(
        prompt_ids=prompt, output_ids=output, output_logprobs=logprobs, finish_reason="stop"
    )


async def test_a_200k_token_record_is_claim_checked_and_reconstructs_exactly(bus):
    rng = random.Random(4)
    prompt = [rng.randrange(151_936) for _ in range(200_000)]  # a Qwen-sized vocabulary
    out0, out1 = [rng.randrange(151_936) for _ in range(400)], [7, 8, 9]
    text = " ".join(f"w{i}" for i in range(150_000))  # the conversation the harness sent
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
    rec0 = build_record(_ctx(raw), 0, PromptPlan(prompt, None, None, None), _gen(prompt, out0))
    base = TurnState(
        seq=0, messages=[], reply={}, tools_key="", prompt=pack(prompt), output=pack(out0)
    )
    prompt1 = prompt + out0 + [11, 12, 13]
    rec1 = build_record(_ctx(raw), 1, PromptPlan(prompt1, base, True, None), _gen(prompt1, out1))
    for rec in (rec0, rec1):
        await commit(bus, rec)

    sub = await bus.js.subscribe(S.completions("big-0000"), ordered_consumer=True)
    msgs = [await sub.next_msg(timeout=10) for _ in range(2)]
    await sub.unsubscribe()
    assert all(m.headers and m.headers.get(CLAIM_HEADER) and not m.data for m in msgs)
    back = [decode(await bus.payload(m), CompletionRecord) for m in msgs]
    assert [encode(r) for r in back] == [encode(rec0), encode(rec1)]
    assert back[1].prompt_base_seq == 0 and back[1].prompt_ids == [11, 12, 13]
    prompts = reconstruct_prompts(back)
    assert prompts[0] == prompt and prompts[1] == prompt1
    prompt_bytes = [len(msgspec.json.encode(r.prompt_ids)) for r in back]
    print(
        f"\n200k record: {len(encode(rec0)) / 1e6:.2f} MB (prompt ids {prompt_bytes[0] / 1e6:.2f}"
        f" MB); next call {len(encode(rec1)) / 1e6:.2f} MB (prompt ids {prompt_bytes[1]} B,"
        f" raw request {len(raw) / 1e6:.2f} MB)"
    )


async def test_a_long_prompt_through_the_proxy_is_stored_once(proxy, tok, redis_client, bus):
    session = await new_session(redis_client, "long")
    agent = ChatAgent(proxy.url, session.token)
    agent.messages[1]["content"] = " ".join(f"line {i}: value {i * 7 % 1000};" for i in range(800))
    await run_loop(agent, 4)
    recs = await captured(bus, session.session_id, expect=4)
    prompts = reconstruct_prompts(recs)
    assert len(prompts[0]) > 6000 and recs[0].prompt_base_seq is None
    for prev, rec in zip(recs, recs[1:], strict=False):
        assert rec.prompt_base_seq == prev.seq and rec.extends_previous
        assert len(rec.prompt_ids) < 100  # the tail: tool result + template glue
    sizes = [len(encode(r)) for r in recs]
    ids = [len(msgspec.json.encode(r.prompt_ids)) for r in recs]
    print(f"\nlong prompt {len(prompts[0])} tokens: record bytes {sizes}, prompt-id bytes {ids}")


# -- metrics, side calls, count_tokens ----------------------------------------------------
async def test_metrics_per_protocol_match_the_records(proxy, redis_client, bus):
    before = (await get(proxy.url + "/metrics")).text
    sessions = [await new_session(redis_client, f"metrics-{i}") for i in range(2)]
    chat, claude = (
        ChatAgent(proxy.url, sessions[0].token),
        AnthropicAgent(proxy.url, sessions[1].token),
    )
    await asyncio.gather(run_loop(chat, 3), run_loop(claude, 2))
    # a sub-agent in the chat session: another system prompt, so a recorded break
    chat.messages = [{"role": "system", "content": "You are a sub-agent."}, chat.messages[1]]
    await chat.step(stream=False)
    after = (await get(proxy.url + "/metrics")).text
    recs = {
        "openai_chat": await captured(bus, sessions[0].session_id, expect=4),
        "anthropic_messages": await captured(bus, sessions[1].session_id, expect=2),
    }

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    for protocol, rs in recs.items():
        prompts = reconstruct_prompts(rs)
        assert delta("polar_proxy_calls_total", protocol=protocol, result="ok") == len(rs)
        assert delta("polar_proxy_call_seconds_count", protocol=protocol) == len(rs)
        assert delta("polar_proxy_overhead_seconds_count", protocol=protocol) == len(rs)
        tokens_in = sum(len(p) for p in prompts.values())
        assert delta("polar_proxy_tokens_total", protocol=protocol, direction="in") == tokens_in
        tokens_out = sum(len(r.output_ids) for r in rs)
        assert delta("polar_proxy_tokens_total", protocol=protocol, direction="out") == tokens_out
    assert recs["openai_chat"][-1].drift_reason == "system_prompt_changed"
    reason = {"protocol": "openai_chat", "reason": "system_prompt_changed"}
    assert delta("polar_proxy_prompt_breaks_total", **reason) == 1
    assert delta("polar_proxy_call_seconds_sum", protocol="openai_chat") > 0


async def test_side_calls_are_tagged_and_count_tokens_uses_the_tokenizer(
    proxy, tok, redis_client, bus
):
    session = await new_session(redis_client, "side")
    base = f"{proxy.url}/s/{session.token}"
    oai = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    claude = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)
    gem = genai.Client(api_key="x", http_options=gt.HttpOptions(base_url=base))
    title_system = "You are a title generator. You output ONLY a thread title."
    await oai.chat.completions.create(  # opencode's first call
        model="m",
        messages=[
            {"role": "system", "content": title_system},
            {"role": "user", "content": "fix the failing test"},
        ],
    )
    await gem.aio.models.generate_content(  # Gemini CLI's router
        model="m",
        contents="fix the failing test",
        config=gt.GenerateContentConfig(
            response_mime_type="application/json",
            response_json_schema={
                "type": "object",
                "properties": {"model_choice": {"type": "string"}},
            },
        ),
    )
    await claude.messages.create(  # Claude Code's quota probe
        model="m", max_tokens=1, messages=[{"role": "user", "content": "quota"}]
    )
    recs = await captured(bus, session.session_id, expect=3)
    assert [r.side_call for r in recs] == ["title", "router", "probe"]
    assert recs[2].finish_reason == "length" and len(recs[2].output_ids) == 1

    system, user = "You are a coding agent.", "hello there, count me"
    n = await claude.messages.count_tokens(
        model="m", system=system, messages=[{"role": "user", "content": user}]
    )
    expected = len(
        tok.render_ids([{"role": "system", "content": system}, {"role": "user", "content": user}])
    )
    assert n.input_tokens == expected
    g = await gem.aio.models.count_tokens(model="m", contents=user)
    gemini_ids = tok.render_ids([{"role": "user", "content": user}])
    assert g.total_tokens == len(gemini_ids)
    # each count is captured too, tagged, with the prompt it counted and nothing sampled
    recs = await captured(bus, session.session_id, expect=5)
    counts = recs[3:]
    assert [(r.seq, r.side_call, str(r.protocol)) for r in counts] == [
        (3, "count_tokens", "anthropic_messages"),
        (4, "count_tokens", "gemini"),
    ]
    assert len(counts[0].prompt_ids) == expected and counts[1].prompt_ids == gemini_ids
    assert all(r.output_ids == [] and not r.void and not r.aborted for r in counts)


# -- pause / resume / weight updates ------------------------------------------------------
async def test_pause_drains_in_flight_calls_and_holds_new_ones(proxy, redis_client, bus):
    slow_s, new_s = (
        await new_session(redis_client, "pause-a"),
        await new_session(redis_client, "pause-b"),
    )
    sdk = openai.AsyncOpenAI(base_url=f"{proxy.url}/s/{slow_s.token}/v1", api_key="x")
    # long enough to still be in the engine when the pause comes on a fast CPU (~0.5 s)
    slow = asyncio.create_task(
        sdk.chat.completions.create(model="m", messages=SLOW, max_tokens=1500)
    )
    await wait_in_flight(proxy.url)  # it is in the engine now
    assert (await post(proxy.url + "/admin/pause")).status_code == 401  # the admin token
    paused = await post(proxy.url + "/admin/pause", headers=ADMIN)
    assert paused.json() == {"paused": True, "drained": 1}
    (rec,) = await captured(bus, slow_s.session_id, expect=1)  # drained = answered and captured
    assert len(rec.output_ids) == 1500
    await slow
    metrics = (await get(proxy.url + "/metrics")).text
    assert metric(metrics, "polar_proxy_paused") == 1

    waiting = asyncio.create_task(run_loop(ChatAgent(proxy.url, new_s.token), 1))
    done, _ = await asyncio.wait({waiting}, timeout=1.5)
    assert not done  # a new call waits while paused
    assert (await post(proxy.url + "/admin/resume", headers=ADMIN)).json() == {"paused": False}
    (step,) = await asyncio.wait_for(waiting, 30)
    assert step.call is not None
    (rec,) = await captured(bus, new_s.session_id, expect=1)
    assert rec.timings.queue_ms >= 1400  # the wait is on the record
    assert metric((await get(proxy.url + "/metrics")).text, "polar_proxy_paused") == 0


async def test_weight_update_versions_every_record(proxy, redis_client, bus):
    """Last in this module: the engine serves the second checkpoint afterwards."""
    early, late = (
        await new_session(redis_client, "w-early"),
        await new_session(redis_client, "w-late"),
    )
    sdk = openai.AsyncOpenAI(base_url=f"{proxy.url}/s/{early.token}/v1", api_key="x")
    # 1,500 tokens: long enough to be seen in flight (300 took ~0.12 s on a quiet CPU and
    # could finish between two polls of wait_in_flight)
    in_flight = asyncio.create_task(
        sdk.chat.completions.create(model="m", messages=SLOW, max_tokens=1500)
    )
    await wait_in_flight(proxy.url)
    body = {"model_path": str(second_checkpoint()), "version": "2"}
    update = asyncio.create_task(
        post(proxy.url + "/admin/update_weights", json=body, headers=ADMIN)
    )
    # the late calls go once the update has observably begun (after a fixed 0.2 s, a
    # loaded machine could still be delivering it, and they were served version 1)
    await wait_until(lambda: update.done() or paused(proxy.url), 60, "the update under way")
    agent = ChatAgent(proxy.url, late.token)
    after_update = asyncio.create_task(run_loop(agent, 2))  # waits for the update
    answer = await update
    assert answer.status_code == 200 and answer.json() == {"ok": True, "weight_version": "2"}
    await in_flight
    await after_update
    (old,) = await captured(bus, early.session_id, expect=1)
    new = await captured(bus, late.session_id, expect=2)
    assert old.weight_version == "1" and [r.weight_version for r in new] == ["2", "2"]
    assert (await get(proxy.url + "/admin/weight_version", headers=ADMIN)).json() == {
        "weight_version": "2"
    }
    # the new records' logprobs are the new checkpoint's, not the old one's
    prompts = reconstruct_prompts(new)
    full = prompts[1] + new[1].output_ids
    v1, v2 = load_model(tiny_model_dir()), load_model(second_checkpoint())
    for model, close in ((v2, True), (v1, False)):
        truth = model.teacher_forced_logprobs(full, len(prompts[1]))
        diff = max(abs(a - b) for a, b in zip(truth, new[1].output_logprobs, strict=True))
        assert (diff <= 1e-4) is close, diff
    bad = await post(
        proxy.url + "/admin/update_weights", json={"model_path": "/nope"}, headers=ADMIN
    )
    assert bad.status_code == 400 and bad.json()["ok"] is False
