"""Chat mode: why an engine-templated prompt did not extend the previous call, judged on
the tiny model's real tokenizer and chat template (the engine's templating re-done here)."""

from __future__ import annotations

import pytest

from proxy.tito import TurnState, judge_chat_prompt, pack, tools_key
from services.common.tokenization import ChatTokenizer
from tests.unit.engine.tiny import tiny_model_dir

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "exec_command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]
HISTORY = [
    {"role": "system", "content": "You are a coder."},
    {"role": "user", "content": "fix it"},
]
REPLY = {
    "role": "assistant",
    "content": "Looking.",
    "reasoning_content": "First list the files.",
    "tool_calls": [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "exec_command", "arguments": '{"cmd": "ls"}'},
        }
    ],
}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "a.py\n"}


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.load(tiny_model_dir())


@pytest.fixture(scope="module")
def state(tok):
    prompt = tok.render_ids(HISTORY, TOOLS)
    output = tok.encode(tok.assistant_reply_text(REPLY))  # what the model sampled
    return TurnState(
        seq=0,
        messages=HISTORY,
        reply=REPLY,
        tools_key=tools_key(TOOLS),
        prompt=pack(prompt),
        output=pack(output),
    )


def judged(tok, state, echoed: dict, history=HISTORY):
    """The engine re-templates what the client sent; the proxy judges the result."""
    messages = [*history, echoed, RESULT]
    return judge_chat_prompt(tok.render_ids(messages, TOOLS), messages, TOOLS, [state])


def test_a_faithful_echo_extends(tok, state):
    plan = judged(tok, state, REPLY)
    assert plan.extends is True and plan.drift_reason is None and plan.base is state


def test_dropped_reasoning(tok, state):
    echoed = {k: v for k, v in REPLY.items() if k != "reasoning_content"}
    assert judged(tok, state, echoed).drift_reason == "reasoning_dropped"


def test_reserialized_tool_arguments(tok, state):
    call = {
        "id": "x9",
        "type": "function",
        "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'},
    }
    echoed = {**REPLY, "tool_calls": [call]}
    plan = judged(tok, state, echoed)
    assert plan.extends is False and plan.drift_reason == "tool_arguments_reserialized"


def test_changed_assistant_text(tok, state):
    echoed = {**REPLY, "content": "Looking. "}  # same after strip: still continues the state
    assert judged(tok, state, echoed).drift_reason == "assistant_text_changed"


def test_history_rendered_differently(tok, state):
    # the client sends the system prompt as text parts the template joins differently
    history = [{"role": "system", "content": "You are a coder. "}, HISTORY[1]]
    assert judged(tok, state, REPLY, history=history).drift_reason == "history_rerendered"


def test_template_renders_the_answer_otherwise(tok, state):
    # sampled ids that decode to the reply but are not how the template tokenizes it
    text = tok.assistant_reply_text(REPLY)
    split = [i for ch in text[:8] for i in tok.encode(ch)] + tok.encode(text[8:])
    assert split != list(state.output_ids)
    odd = TurnState(
        seq=0,
        messages=HISTORY,
        reply=REPLY,
        tools_key=state.tools_key,
        prompt=state.prompt,
        output=pack(split),
    )
    engine_prompt = tok.render_ids([*HISTORY, REPLY, RESULT], TOOLS)
    plan = judge_chat_prompt(engine_prompt, [*HISTORY, REPLY, RESULT], TOOLS, [odd])
    assert plan.drift_reason == "response_retokenized"


def test_the_record_and_the_trace_name_a_re_rendered_answer_alike(tok, state):
    """One word for one event: the proxy's drift_reason on the record and the builder's
    break_reason on the trace it starts."""
    from schemas import Outcome, UpstreamMode
    from services.builder.strategies.prefix_merging import PrefixMerging
    from tests.unit.builder.synth import Capture

    text = tok.assistant_reply_text(REPLY)
    split = [i for ch in text[:8] for i in tok.encode(ch)] + tok.encode(text[8:])
    odd = TurnState(
        seq=0,
        messages=HISTORY,
        reply=REPLY,
        tools_key=state.tools_key,
        prompt=state.prompt,
        output=pack(split),
    )
    engine_prompt = tok.render_ids([*HISTORY, REPLY, RESULT], TOOLS)
    plan = judge_chat_prompt(engine_prompt, [*HISTORY, REPLY, RESULT], TOOLS, [odd])
    cap = Capture(mode=UpstreamMode.CHAT)
    cap.call(list(odd.prompt_ids), split)
    cap.call(engine_prompt, tok.encode("done"), finish="stop", drift_reason=plan.drift_reason)
    traces, _, _ = PrefixMerging().build(cap.records, {}, Outcome.COMPLETED)
    assert [t.break_reason for t in traces] == ["first", plan.drift_reason]
