"""TITO exactness end to end: 30-turn tool-using sessions through every protocol's SDK,
the real proxy process and the embedded engine, checked from the captured records.

Token mode: every prompt extends the previous prompt + sampled output token for token,
and the captured logprobs equal a teacher-forced recomputation under the model's weights.
Chat mode (the engine templates): the same sessions report where re-templating drifted,
with a reason, in the records and in ``polar_proxy_prompt_breaks_total``.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from schemas import subjects as S
from schemas.completion import reconstruct_prompts
from services.common.registry import Registry
from services.engine.weights import load_model
from tests.helpers.stack import (
    proxy_process,
    running_session,
)
from tests.integration.proxy_agents import (
    AGENTS,
    TOOL,
    ChatAgent,
    captured,
    run_loop,
    tool_output,
)
from tests.unit.engine.tiny import tiny_model_dir

pytestmark = pytest.mark.asyncio
TURNS = 30
LOGPROB_TOLERANCE = 1e-4  # float32 forward, batched and cached vs. one full pass


@pytest.fixture(scope="module")
def token_proxy(engine, nats_url, redis_url, tmp_path_factory):
    with proxy_process(nats_url, redis_url, engine, tmp_path_factory.mktemp("t")) as p:
        yield p


@pytest.fixture(scope="module")
def chat_proxy(engine, nats_url, redis_url, tmp_path_factory):
    with proxy_process(nats_url, redis_url, engine, tmp_path_factory.mktemp("c"), mode="chat") as p:
        yield p


@pytest.fixture(scope="module")
def model():
    return load_model(tiny_model_dir())


async def run_sessions(proxy, redis_client, bus, task_id: str, **agent_kw):
    """One 30-turn session per protocol, all at once; (agent, steps, records) each."""
    reg = Registry(redis_client)
    sessions = await running_session(reg, task_id, n=len(AGENTS))
    agents = [cls(proxy.url, s.token, **agent_kw) for cls, s in zip(AGENTS, sessions, strict=True)]
    runs = await asyncio.gather(*(run_loop(a, TURNS) for a in agents))
    out = []
    for agent, steps, session in zip(agents, runs, sessions, strict=True):
        recs = await captured(bus, session.session_id, expect=TURNS)
        out.append((agent, steps, recs))
    return out


def assert_loop_ran(agent, steps) -> None:
    assert len(steps) == TURNS, agent.protocol
    assert all(s.call and s.call[0] == TOOL and "cmd" in s.call[1] for s in steps[:-1])
    assert steps[-1].call is None and "All checks pass" in steps[-1].text
    assert steps[0].reasoning and steps[-1].reasoning  # the policy's reasoning reached the SDK


def max_logprob_diff(model, recs, prompts) -> float:
    """Largest |captured - teacher-forced| logprob over every output token of ``recs``.

    The prompts extend each other exactly, so one forward pass over the last call's
    prompt + output scores every earlier call's output at the same positions.
    """
    last = recs[-1]
    full = prompts[last.seq] + last.output_ids
    start = len(prompts[recs[0].seq])
    truth = model.teacher_forced_logprobs(full, start)
    worst = 0.0
    for r in recs:
        at = len(prompts[r.seq])
        assert full[at : at + len(r.output_ids)] == r.output_ids
        expected = truth[at - start : at - start + len(r.output_ids)]
        assert len(expected) == len(r.output_logprobs) == len(r.output_ids) > 0
        worst = max(worst, *(abs(a - b) for a, b in zip(expected, r.output_logprobs, strict=True)))
    return worst


async def test_token_mode_thirty_turns_every_protocol_zero_drift(
    token_proxy, model, redis_client, bus
):
    t0 = time.monotonic()
    results = await run_sessions(token_proxy, redis_client, bus, "tito-token")
    print(f"\n{len(results)} sessions x {TURNS} calls in {time.monotonic() - t0:.1f}s")
    report = {}
    for agent, steps, recs in results:
        assert_loop_ran(agent, steps)
        assert [r.seq for r in recs] == list(range(TURNS)), agent.protocol
        assert all(r.protocol == agent.protocol and r.mode == "token" for r in recs)
        assert recs[0].extends_previous is None
        drift = [(r.seq, r.drift_reason) for r in recs[1:] if r.extends_previous is not True]
        assert drift == [], (agent.protocol, drift)
        prompts = reconstruct_prompts(recs)
        for prev, cur in zip(recs, recs[1:], strict=False):
            head = prompts[prev.seq] + prev.output_ids
            assert prompts[cur.seq][: len(head)] == head, (agent.protocol, cur.seq)
            assert cur.prompt_base_seq == prev.seq and len(cur.prompt_ids) < 200
        diff = max_logprob_diff(model, recs, prompts)
        assert diff <= LOGPROB_TOLERANCE, (agent.protocol, diff)
        report[agent.protocol] = (len(prompts[TURNS - 1]), diff)
        assert_builds_one_chain(recs, prompts)
    print("\ntoken mode (final prompt tokens, max |logprob diff|):", report)


def assert_builds_one_chain(recs, prompts) -> None:
    """Issue 6: this real 30-call capture merges into one chain equal to the last prompt +
    response, masked exactly on the sampled tokens; per_request gives 30 traces."""
    from schemas import Outcome
    from services.builder.strategies.per_request import PerRequest
    from services.builder.strategies.prefix_merging import PrefixMerging

    traces, stats, _ = PrefixMerging().build(recs, {}, Outcome.COMPLETED)
    (chain,) = traces
    last = recs[-1]
    assert chain.prompt_ids + chain.response_ids == prompts[last.seq] + last.output_ids
    sampled = [t for r in recs for t in r.output_ids]
    assert sum(chain.loss_mask) == len(sampled) == stats.sampled_tokens
    masked = [t for t, m in zip(chain.response_ids, chain.loss_mask, strict=True) if m]
    assert masked == sampled
    per_request = PerRequest().build(recs, {}, Outcome.COMPLETED)[0]
    assert len(per_request) == TURNS


def break_counts(metrics_text: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith("polar_proxy_prompt_breaks_total{"):
            labels, value = line[len("polar_proxy_prompt_breaks_total{") :].split("} ")
            kv = dict(p.split("=", 1) for p in labels.split(","))
            out[(kv["protocol"].strip('"'), kv["reason"].strip('"'))] = float(value)
    return out


def expected_drift(protocol: str, steps) -> dict[str, int]:
    """Where the engine's re-templating must differ from what the model sampled: after a
    turn with reasoning (the client dropped it). Tool arguments that a protocol carries
    as objects (Anthropic ``input``, Gemini ``args``) are re-serialized the way the model
    wrote them, so they cause no drift."""
    dropped = sum(1 for step in steps[:-1] if step.reasoning)
    return {"reasoning_dropped": dropped} if dropped else {}


async def test_chat_mode_same_sessions_report_drift_with_reasons(chat_proxy, redis_client, bus):
    results = await run_sessions(chat_proxy, redis_client, bus, "tito-chat", echo_reasoning=False)
    async with httpx.AsyncClient() as http:
        metrics = break_counts((await http.get(chat_proxy.url + "/metrics")).text)
    report = {}
    for agent, steps, recs in results:
        assert_loop_ran(agent, steps)
        assert [r.seq for r in recs] == list(range(TURNS)), agent.protocol
        assert all(r.mode == "chat" for r in recs)
        reasons: dict[str, int] = {}
        for r in recs[1:]:
            if r.extends_previous is False:
                assert r.drift_reason, (agent.protocol, r.seq)
                reasons[r.drift_reason] = reasons.get(r.drift_reason, 0) + 1
            else:
                assert r.extends_previous is True and r.drift_reason is None
        assert reasons == expected_drift(agent.protocol, steps), agent.protocol
        for reason, n in reasons.items():
            assert metrics[(agent.protocol, reason)] == n, (agent.protocol, reason)
        report[agent.protocol] = reasons
    print("\nchat mode drift by reason:", report)


async def test_a_growing_conversation_keeps_two_states_and_other_branches_survive(
    token_proxy, redis_client, bus
):
    """A call that continues a state supersedes that state's own base: a conversation
    that only grows keeps its tip and the state before it (which a retry of the tip's
    call continues), so a side branch is not pushed out of the session's MAX_STATES by
    the main loop's turns (before: 8 snapshots of the main loop, the side's state gone
    after 8 turns) and a long session's lookup reads 2 histories, not 8."""
    (session,) = await running_session(Registry(redis_client), "tito-branches", n=1)
    main = ChatAgent(token_proxy.url, session.token)
    side = ChatAgent(token_proxy.url, session.token)
    side.messages[0] = {"role": "system", "content": "You title conversations."}
    await main.step(stream=False)  # call 0
    main.add_result(tool_output(0, last=False))
    await side.step(stream=False)  # call 1: another branch (its own system prompt)
    side.add_result(tool_output(1, last=False))
    for i in range(10):  # calls 2..11, each continuing the one before
        await main.step(stream=False)
        if i < 9:
            main.add_result(tool_output(i + 2, last=False))
    await side.step(stream=False)  # call 12: the side branch, ten main turns later
    main.messages.pop()  # call 13: call 11 again (its answer never arrived, say)
    await main.step(stream=False)

    recs = {r.seq: r for r in await captured(bus, session.session_id, expect=14)}
    assert sorted(recs) == list(range(14))
    assert all(recs[s].extends_previous and recs[s].prompt_base_seq == s - 1 for s in range(3, 12))
    assert recs[12].extends_previous is True and recs[12].prompt_base_seq == 1
    assert recs[13].extends_previous is True and recs[13].prompt_base_seq == 10
    stored = await redis_client.lrange(S.key_tito(session.session_id, 0), 0, -1)
    assert sorted(int(item.split(b":", 1)[0]) for item in stored) == [1, 10, 11, 12, 13]
