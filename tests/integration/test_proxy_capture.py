"""The proxy service end to end: real SDKs -> proxy -> embedded engine, every call
captured in JetStream before the reply, token-exact."""

import anthropic
import msgspec
import openai
import pytest

from schemas import CompletionRecord, SessionState, decode
from schemas import subjects as S
from schemas.completion import reconstruct_prompts
from services.common.registry import Registry
from tests.helpers.stack import (
    embedded_engine,
    proxy_process,
    running_session,
)
from tests.helpers.streams import stored_messages

pytestmark = pytest.mark.asyncio
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with embedded_engine("shell_agent.yaml", tmp_path_factory.mktemp("logs")) as srv:
        yield srv


@pytest.fixture(scope="module")
def proxy(engine, nats_url, redis_url, tmp_path_factory):
    with proxy_process(nats_url, redis_url, engine, tmp_path_factory.mktemp("plogs")) as p:
        yield p


@pytest.fixture(scope="module")
def chat_proxy(engine, nats_url, redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("chatlogs")
    with proxy_process(nats_url, redis_url, engine, logs, mode="chat") as p:
        yield p


async def records(bus, session_id: str) -> list[CompletionRecord]:
    msgs = await stored_messages(bus, S.completions(session_id))
    return [decode(await bus.payload(m), CompletionRecord) for m in msgs]


async def test_openai_tool_round_trip_is_captured_token_exact(proxy, bus, redis_client):
    reg = Registry(redis_client, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    (session,) = await running_session(reg, "px-openai")
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/s/{session.token}/v1", api_key="unused")
    messages = [
        {"role": "system", "content": "You are a shell agent."},
        {"role": "user", "content": "What is here?"},
    ]
    first = await client.chat.completions.create(model="my-model", messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    assert first.model == "my-model" and call.function.name == "bash"
    assert '"ls -la"' in call.function.arguments
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "README.md\n"},
    ]
    stream = await client.chat.completions.create(
        model="my-model", messages=messages, tools=TOOLS, stream=True
    )
    chunks = [c async for c in stream]
    assert any(c.choices and c.choices[0].delta.tool_calls for c in chunks)

    recs = await records(bus, session.session_id)
    assert [r.seq for r in recs] == [0, 1]
    assert recs[1].extends_previous is True and recs[1].prompt_base_seq == 0
    prompts = reconstruct_prompts(recs)
    assert (
        prompts[1][: len(prompts[0]) + len(recs[0].output_ids)] == prompts[0] + recs[0].output_ids
    )
    for r in recs:
        assert len(r.output_logprobs) == len(r.output_ids) > 0
        assert r.weight_version and r.protocol == "openai_chat" and r.mode == "token"
        assert all(lp <= 0 for lp in r.output_logprobs)
    # each record carries the answer the harness got, as the next request echoes it
    sent = msgspec.json.decode(recs[0].reply)
    assert sent["tool_calls"][0]["function"] == {
        "name": "bash", "arguments": call.function.arguments,
    }  # fmt: skip
    assert sent["tool_calls"][0]["id"] == call.id
    final = msgspec.json.decode(recs[1].reply)
    assert final["role"] == "assistant" and final.get("tool_calls")


async def test_anthropic_sdk_with_key_header(proxy, bus, redis_client):
    reg = Registry(redis_client)
    (session,) = await running_session(reg, "px-anthropic")
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=session.token)
    msg = await client.messages.create(
        model="claude-x",
        max_tokens=200,
        system="You are a shell agent.",
        messages=[{"role": "user", "content": "look around"}],
        tools=[{"name": "bash", "input_schema": TOOLS[0]["function"]["parameters"]}],
    )
    assert msg.model == "claude-x" and msg.content[-1].type == "tool_use"
    recs = await records(bus, session.session_id)
    assert len(recs) == 1 and recs[0].protocol == "anthropic_messages"


async def test_tokens_only_valid_while_running(proxy, bus, redis_client):
    reg = Registry(redis_client)
    (session,) = await running_session(reg, "px-auth")
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="ps_not_a_session")
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    _, early = await reg.create_task(
        __import__("schemas").TaskRequest(task_id="px-auth2", instruction="x")
    )
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=early[0].token)
    with pytest.raises(openai.AuthenticationError):  # REGISTERED: not running yet
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert (
        0 < await redis_client.ttl(S.key_token(early[0].token)) <= 3600 + 3600 + 1
    )  # EXAT rounds the deadline up
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=session.token)
    ok = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}]
    )
    assert ok.choices
    # issue 17.5: a token stayed valid 30 s after its session left RUNNING, and the calls
    # served then were captured after the builder had read the session
    assert (await reg.transition(session.session_id, SessionState.CANCELLED)).ok
    with pytest.raises(openai.AuthenticationError):  # refused at once, in its protocol
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert not await redis_client.exists(S.key_token(session.token))  # no key left behind


@pytest.mark.parametrize(("which", "mode"), [("proxy", "token"), ("chat_proxy", "chat")])
async def test_a_tool_call_turn_is_recorded_as_tool_calls_in_either_mode(
    request, which, mode, bus, redis_client
):
    """Token mode: the engine stops at end of turn and the proxy parses the call; chat
    mode: the engine parses it. The record says the same in both."""
    proxy = request.getfixturevalue(which)
    reg = Registry(redis_client, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    (session,) = await running_session(reg, f"px-finish-{mode}")
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/s/{session.token}/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is here?"}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.tool_calls
    (rec,) = await records(bus, session.session_id)
    assert rec.mode == mode and rec.finish_reason == "tool_calls"


def _function(*order: str) -> dict:
    fields = {
        "name": "bash",
        "description": "run a command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
    return {"type": "function", "function": {k: fields[k] for k in order}}


@pytest.mark.parametrize(
    "order", [("name", "description", "parameters"), ("name", "parameters", "description")]
)
async def test_the_first_prompt_is_the_models_own_template_of_the_harness_tools(
    order, proxy, bus, redis_client
):
    """Token mode renders each tool with its fields in the order the harness sent them:
    the prompt is what `apply_chat_template` gives on the harness's own tools, as the
    model sees them when served."""
    from transformers import AutoTokenizer

    from tests.helpers.stack import tiny_model_dir

    tools = [_function(*order)]
    reg = Registry(redis_client, publish=lambda s, p, m: bus.publish(s, p, msg_id=m))
    (session,) = await running_session(reg, f"px-order-{order[1]}")
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/s/{session.token}/v1", api_key="unused")
    messages = [
        {"role": "system", "content": "You are a shell agent."},
        {"role": "user", "content": "What is here?"},
    ]
    await client.chat.completions.create(model="m", messages=messages, tools=tools)
    (rec,) = await records(bus, session.session_id)
    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    own = hf.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert reconstruct_prompts([rec])[0] == list(own)
