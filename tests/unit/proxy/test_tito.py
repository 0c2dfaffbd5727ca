"""TITO prompt planning on the real tiny model's tokenizer and chat template."""

import orjson
import pytest

from proxy.tito import (
    TurnState,
    classify_break,
    head_text,
    judge_chat_prompt,
    pack,
    plan_token_prompt,
    tools_key,
)
from services.common.tokenization import ChatTokenizer
from tests.unit.engine.tiny import tiny_model_dir

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "exec_command",
            "description": "run",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.load(tiny_model_dir())


def sampled(tok, reply: dict, *, closed: bool = True) -> list[int]:
    """Ids a model would have sampled to produce ``reply`` (end-of-turn included)."""
    text = tok.assistant_reply_text(reply)
    ids = tok.encode(text)
    return ids if closed else ids[:-1]


def state(seq, messages, reply, prompt, output, tools=TOOLS) -> TurnState:
    return TurnState(
        seq=seq,
        messages=messages,
        reply=reply,
        tools_key=tools_key(tools),
        prompt=pack(prompt),
        output=pack(output),
    )


def call(i: int, args: str) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "reasoning_content": f"thinking {i}",
        "tool_calls": [
            {
                "id": f"c{i}",
                "type": "function",
                "function": {"name": "exec_command", "arguments": args},
            }
        ],
    }


def test_thirty_turns_extend_exactly_despite_harness_rewrites(tok):
    messages = [
        {"role": "system", "content": "You are a coder."},
        {"role": "user", "content": "fix the bug"},
    ]
    states: list[TurnState] = []
    prev_full = None
    for i in range(30):
        plan = plan_token_prompt(tok, messages, TOOLS, states)
        if i == 0:
            assert plan.extends is None and plan.prompt_ids == tok.render_ids(messages, TOOLS)
        else:
            assert plan.extends is True and plan.drift_reason is None
            assert plan.prompt_ids[: len(prev_full)] == prev_full
        reply = call(i, orjson.dumps({"cmd": f"echo {i}"}).decode())
        output = sampled(tok, reply, closed=(i % 7 != 3))  # some turns cut by `length`
        states.append(state(i, list(messages), reply, plan.prompt_ids, output))
        prev_full = plan.prompt_ids + output
        # The harness echoes the call back re-serialized and without its reasoning,
        # with a fresh id, then adds the tool result.
        echoed = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"x{i}",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": f'{{ "cmd" : "echo {i}" }}'},
                }
            ],
        }
        messages = [
            *messages,
            echoed,
            {"role": "tool", "tool_call_id": f"x{i}", "content": f"{i}\n"},
        ]
    # the glue of the last turn decodes to the tool result framed by the template
    glue = plan.prompt_ids[len(states[-2].prompt_ids) + len(states[-2].output_ids) :]
    assert "<tool_response>\n28\n\n</tool_response>" in tok.decode(glue, skip_special_tokens=False)


def test_head_texts_rendered_ahead_give_the_same_prompts(tok):
    """The proxy renders each answered call's head text once the answer is out; the call
    continuing it then renders its conversation once. Same prompts, token for token."""
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "go"}]
    states: list[TurnState] = []
    heads: dict[int, str] = {}
    used: list[int] = []

    def ahead(st: TurnState) -> str | None:
        used.append(st.seq)
        return heads.get(st.seq)

    for i in range(12):
        plain = plan_token_prompt(tok, messages, TOOLS, states)
        cached = plan_token_prompt(tok, messages, TOOLS, states, heads=ahead)
        assert cached.prompt_ids == plain.prompt_ids and cached.extends == plain.extends
        reply = call(i, orjson.dumps({"cmd": f"ls {i}"}).decode())
        output = sampled(tok, reply, closed=(i % 5 != 2))
        st = state(i, list(messages), reply, plain.prompt_ids, output)
        states.append(st)
        if i % 4 != 1:  # some heads never prepared (the call came to another replica)
            heads[i] = head_text(tok, st, TOOLS)
        messages = [*messages, reply, {"role": "tool", "tool_call_id": f"c{i}", "content": "ok"}]
    assert used == list(range(11))  # every continuing call asked for its base's head
    # and a head text is what is used: a wrong one changes the prompt
    reply = call(12, "{}")
    states.append(state(11, list(messages), reply, plain.prompt_ids, sampled(tok, reply)))
    messages = [*messages, reply, {"role": "tool", "tool_call_id": "c12", "content": "ok"}]
    right = plan_token_prompt(tok, messages, TOOLS, states)
    wrong = plan_token_prompt(tok, messages, TOOLS, states, heads=lambda st: heads[10] + "X")
    assert wrong.prompt_ids != right.prompt_ids


def test_length_cut_turn_is_closed_by_glue(tok):
    messages = [{"role": "user", "content": "hi"}]
    reply = {"role": "assistant", "content": "hello there"}
    prompt = tok.render_ids(messages, None)
    cut = sampled(tok, reply, closed=False)
    st = state(0, messages, reply, prompt, cut, tools=None)
    nxt = [*messages, reply, {"role": "user", "content": "more"}]
    plan = plan_token_prompt(tok, nxt, None, [st])
    assert plan.extends
    glue = plan.prompt_ids[len(prompt) + len(cut) :]
    assert tok.decode(glue, skip_special_tokens=False).startswith("<|im_end|>\n<|im_start|>user")


def test_breaks_are_classified(tok):
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "task"}]
    reply = {"role": "assistant", "content": "ok"}
    st = state(0, base, reply, tok.render_ids(base, TOOLS), sampled(tok, reply))
    key = tools_key(TOOLS)
    sub = [{"role": "system", "content": "You are a sub-agent"}, {"role": "user", "content": "x"}]
    assert classify_break(sub, key, [st]) == "system_prompt_changed"
    assert (
        classify_break(base + [reply, {"role": "user", "content": "u"}], tools_key(None), [st])
        == "tools_changed"
    )
    assert (
        classify_break(base[:1] + [{"role": "user", "content": "other"}], key, [st])
        == "new_conversation"
    )
    assert classify_break(base, key, [st]) == "history_truncated"
    wrong = [
        *base,
        {"role": "assistant", "content": "not what you said"},
        {"role": "user", "content": "u"},
    ]
    assert classify_break(wrong, key, [st]) == "assistant_turn_rewritten"
    plan = plan_token_prompt(tok, sub, TOOLS, [st])
    assert plan.extends is False and plan.drift_reason == "system_prompt_changed"


def test_sub_agent_interleaving_keeps_the_main_chain(tok):
    main = [{"role": "system", "content": "main"}, {"role": "user", "content": "go"}]
    r1 = {"role": "assistant", "content": "step 1"}
    s_main = state(0, main, r1, tok.render_ids(main, TOOLS), sampled(tok, r1))
    sub = [{"role": "system", "content": "sub"}, {"role": "user", "content": "look"}]
    r2 = {"role": "assistant", "content": "found"}
    s_sub = state(1, sub, r2, tok.render_ids(sub, TOOLS), sampled(tok, r2))
    plan = plan_token_prompt(
        tok, [*main, r1, {"role": "user", "content": "next"}], TOOLS, [s_main, s_sub]
    )
    assert plan.extends and plan.base is s_main


def test_chat_mode_drift_is_judged(tok):
    messages = [{"role": "user", "content": "hi"}]
    reply = {"role": "assistant", "content": "yo", "reasoning_content": "think"}
    prompt = tok.render_ids(messages, None)
    out = sampled(tok, reply)
    st = state(0, messages, reply, prompt, out, tools=None)
    nxt = [*messages, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "and?"}]
    rerendered = tok.render_ids(nxt, None)  # what a server-side template would send
    plan = judge_chat_prompt(rerendered, nxt, None, [st])
    assert plan.extends is False and plan.drift_reason == "reasoning_dropped"
    exact = plan_token_prompt(tok, nxt, None, [st]).prompt_ids
    assert judge_chat_prompt(exact, nxt, None, [st]).extends is True
