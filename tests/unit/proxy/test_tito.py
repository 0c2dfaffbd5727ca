"""TITO prompt planning on the real tiny model's tokenizer and chat template."""

import msgspec
import orjson
import pytest

from proxy.backends.base import Generation
from proxy.capture import (
    CallContext,
    DecodedStates,
    build_record,
    decode_states,
    state_cache_cost,
    superseded,
)
from proxy.tito import (
    MAX_STATES,
    TurnState,
    best_continued,
    classify_break,
    head_text,
    judge_chat_prompt,
    pack,
    plan_token_prompt,
    tools_key,
)
from schemas import Protocol, UpstreamMode
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
    wrong = plan_token_prompt(tok, messages, TOOLS, states, heads=lambda st: heads[10])
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
    assert plan.shared == len(prompt) + len(cut) and plan.packed == pack(plan.prompt_ids)
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
    assert classify_break(base, key, [st]) == "history_truncated"  # the same request again
    assert classify_break(base, tools_key(None), [st]) == "tools_changed"  # ... other tools
    assert classify_break(base[:1], key, [st]) == "history_truncated"  # a shorter one
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


def _record(plan, prompt):
    ctx = CallContext(
        session_id="s", attempt=0, protocol=Protocol.OPENAI_CHAT, mode=UpstreamMode.CHAT,
        model="m", raw_request=b"{}", normalized=b"null", user_agent=None, side_call=None,
        received=0.0,
    )  # fmt: skip
    gen = Generation(
        prompt_ids=prompt, output_ids=[7], output_logprobs=[-0.1], finish_reason="stop"
    )
    return build_record(ctx, 9, plan, gen)


def test_what_judging_learned_carries_to_the_record_and_the_state():
    """The prompt packed once and the ids it shares with the call it continued, known
    from the judging: the record and the state come out as if worked out afresh."""
    messages = [{"role": "user", "content": "hi"}]
    reply = {"role": "assistant", "content": "yo"}
    before, out = list(range(100, 180)), [5, 6, 7]
    st = state(3, messages, reply, before, out, tools=None)
    nxt = [*messages, reply, {"role": "user", "content": "and?"}]
    extended = before + out + [8, 9]
    plan = judge_chat_prompt(extended, nxt, None, [st])
    assert plan.extends and plan.shared == 83 and plan.packed == pack(extended)
    record = _record(plan, extended)
    assert (record.prompt_base_seq, record.prompt_base_len, record.prompt_ids) == (3, 83, [8, 9])
    rewritten = before[:70] + [1, 2, 3] + out + [8]  # an earlier turn renders otherwise
    plan = judge_chat_prompt(rewritten, nxt, None, [st])
    assert plan.extends is False and plan.drift_reason == "history_rerendered"
    assert plan.shared == 70 and plan.packed_prompt() == pack(rewritten)
    record = _record(plan, rewritten)
    assert (record.prompt_base_len, record.prompt_ids) == (70, rewritten[70:])
    # ids no vocabulary has cannot be packed: compared as lists, judged all the same
    odd = before + out + [-1]
    plan = judge_chat_prompt(odd, nxt, None, [st])
    assert plan.extends and plan.shared == 83 and plan.packed is None
    assert _record(plan, odd).prompt_ids == [-1]


def test_the_longest_continued_state_is_found_whatever_the_order():
    """Longest first, the newest of equal length; one not continued is passed over for a
    shorter one that is; an echo equal only as the model sees it (call ids, argument
    spacing and reasoning rewritten) still continues."""
    sys_user = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    turn1 = call(1, '{"cmd": "ls"}')
    echoed = {**call(1, '{"cmd":"ls"}'), "reasoning_content": "", "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'}}
    ]}  # fmt: skip
    tool1 = {"role": "tool", "tool_call_id": "c1", "content": "a b"}
    short = state(1, sys_user, turn1, [1], [2])
    long_ = state(2, sys_user + [turn1, tool1], call(2, "{}"), [1], [2])
    long_newer = state(3, sys_user + [turn1, tool1], call(2, "{}"), [1], [2])
    wrong = state(4, sys_user + [turn1, tool1, call(9, "{}")], call(3, "{}"), [1], [2])
    request = sys_user + [echoed, tool1, call(2, "{}"), {"role": "user", "content": "go on"}]
    key = tools_key(TOOLS)
    for states in ([short, long_, long_newer, wrong], [wrong, long_newer, long_, short]):
        assert best_continued(request, key, states) is long_newer
    assert best_continued(request, key, [wrong, short]) is short  # wrong: its turn 3 differs
    assert best_continued(sys_user + [call(7, "{}")], key, [short]) is None  # another answer
    assert best_continued(request, tools_key(None), [long_]) is None  # other tools
    # a session full of states as long as the request (re-sent): none is continued
    resent = [state(n, request, call(5, "{}"), [1], [2]) for n in range(8)]
    assert best_continued(request, key, resent) is None
    assert best_continued(request, key, [*resent, long_]) is long_


def test_a_continued_state_supersedes_its_own_base_only():
    def stored(seq, base):
        s = TurnState(seq=seq, messages=[], reply={}, tools_key="", prompt=b"", output=b"")
        s.base = base
        return b"%d:%s" % (seq, msgspec.msgpack.encode(s))  # as SessionStore.remember does

    raw = [stored(12, 11), stored(11, 10), stored(10, 9), stored(3, None)]
    states = decode_states(raw)
    assert [(s.seq, s.base) for s in states] == [(12, 11), (11, 10), (10, 9), (3, None)]
    # continuing 12 (whose base is 11): 11 goes, 12 stays for a retry of the new call
    assert superseded(raw, states[0]) == raw[1]
    assert superseded(raw, states[3]) is None  # a branch's first state: nothing before it
    assert superseded(raw, None) is None  # continued nothing
    assert superseded(raw[:1], states[0]) is None  # its base already gone
    # the seq is matched whole: state 11 is not state 1
    assert superseded([stored(11, 10)], decode_states([stored(5, 1)])[0]) is None


def _stored(seq: int, text: str = "hi", n_ids: int = 4) -> bytes:
    state = TurnState(
        seq=seq,
        messages=[{"role": "user", "content": text}],
        reply={"role": "assistant", "content": "ok"},
        tools_key="",
        prompt=pack(list(range(n_ids))),
        output=pack([7]),
    )
    return b"%d:%s" % (seq, msgspec.msgpack.encode(state))


def test_decoded_states_are_decoded_once_and_only_while_their_bytes_match():
    cache = DecodedStates()
    raw = [_stored(2), _stored(1)]
    first = cache.decode("s1", 0, raw)
    assert [(s.seq, s.messages) for s in first] == [(2, [{"role": "user", "content": "hi"}])] + [
        (1, [{"role": "user", "content": "hi"}])
    ]
    again = cache.decode("s1", 0, [bytes(r) for r in raw])  # new bytes from a new read
    assert all(a is b for a, b in zip(again, first, strict=True))
    assert [s.seq for s in decode_states(raw)] == [2, 1]  # the same as undecoded-cached
    # the same number taken again by another state (given back, then reused): decoded anew
    (other,) = cache.decode("s1", 0, [_stored(2, "another")])
    assert other is not first[0] and other.messages[0]["content"] == "another"
    # another session's or attempt's state of the same number is its own
    assert cache.decode("s2", 0, raw[:1])[0] is not first[0]
    assert cache.decode("s1", 1, raw[:1])[0] is not first[0]


def test_decoded_states_stay_within_their_byte_budget():
    one = _stored(10)  # as long as each of 10..20
    cache = DecodedStates(budget=state_cache_cost(one) * 8)
    for seq in range(1, 21):  # 20 sessions of one state each
        cache.decode(f"s{seq}", 0, [_stored(seq)])
    assert len(cache) == 8 and cache.lru.used <= cache.lru.budget
    newest = cache.decode("s20", 0, [_stored(20)])[0]
    assert cache.decode("s20", 0, [_stored(20)])[0] is newest  # the newest are kept
    huge = _stored(99, n_ids=len(one))  # over an eighth of the budget: not kept
    assert cache.decode("s99", 0, [huge])[0].seq == 99 and len(cache) == 8
    # a state put by remember is found by the next read
    state = decode_states([_stored(50)])[0]
    cache.put("s20", 0, _stored(50), state)
    assert cache.decode("s20", 0, [_stored(50), _stored(20)])[0] is state


def test_an_attempt_keeps_what_its_last_read_held_and_at_most_max_states():
    cache = DecodedStates()
    raw = [_stored(seq) for seq in range(12, 0, -1)]  # more than a session stores
    cache.decode("s", 0, raw)
    assert len(cache) == MAX_STATES  # the newest numbers
    kept = cache.decode("s", 0, raw[:MAX_STATES])
    assert all(a is b for a, b in zip(kept, cache.decode("s", 0, raw[:MAX_STATES]), strict=True))
    # a read without some of them (superseded, dropped): those go from the cache too
    cache.decode("s", 0, [_stored(13), *raw[:2]])
    assert len(cache) == 3
    # remember's put adds to what is kept, within the bound
    for seq in range(14, 30):
        cache.put("s", 0, _stored(seq), decode_states([_stored(seq)])[0])
    assert len(cache) == MAX_STATES
    # a number taken again by another state replaces it; the cost kept stays the sum
    cache.put("s", 0, _stored(29, "longer text"), decode_states([_stored(29, "longer text")])[0])
    known = cache.lru.entries["s", 0]
    assert len(known.by_seq) == MAX_STATES
    assert known.cost == sum(state_cache_cost(item) for item, _ in known.by_seq.values())
    assert cache.lru.used == known.cost
