"""Token mode on the model families people train: real vocabularies, official templates.

Each session is planned call by call as the proxy plans it (``plan_token_prompt`` over the
session's turn states), the model's answers written in the family's own output format
(``tests/helpers/family_engine.py``'s writers) and read back by the family's parser. The
reference is transformers: the first prompt is ``apply_chat_template`` tokenized, and
every later prompt is the previous prompt + the sampled ids + the template's own text for
the new messages (a suffix of what transformers renders for the whole conversation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pytest

from proxy.tito import (
    KEEP_SAMPLED,
    RERENDER,
    TurnState,
    judge_chat_prompt,
    pack,
    plan_token_prompt,
    tools_key,
)
from services.common.tokenization import ChatTokenizer
from tests.helpers.family_engine import (
    TOOL,
    FamilyEngine,
    option_directive,
    plan_directive,
    reply_directive,
)
from tests.helpers.model_families import FAMILY_FIXTURES, family_model_dir

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": TOOL,
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {
                    "cmd": {"type": "string"},
                    "workdir": {"type": "string"},
                    "timeout_ms": {"type": "integer"},
                },
                "required": ["cmd"],
            },
        },
    }
]
SYSTEM = "You are a coding agent in /repo."
FAMILIES = FAMILY_FIXTURES
# one call per turn in these families' templates (Llama 3.1 refuses two; gpt-oss ends a
# turn at its first call)
ONE_CALL_A_TURN = ("llama3_1", "llama3_2", "gpt_oss")
REASONING = ("qwen3", "qwen3_5", "qwen3_6", "gpt_oss", "deepseek_v3")


@cache
def family(name: str) -> tuple[ChatTokenizer, FamilyEngine]:
    model_dir = family_model_dir(name)
    return ChatTokenizer.load(model_dir), FamilyEngine(model_dir)


@dataclass
class Call:
    plan: Any
    output: list[int]
    finish: str
    parsed: Any
    messages: list[dict[str, Any]]


@dataclass
class Session:
    """A session planned as the proxy plans it; ``calls`` in order."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    policy: str = KEEP_SAMPLED
    calls: list[Call] = field(default_factory=list)
    states: list[TurnState] = field(default_factory=list)

    def run(
        self,
        plan: list[str],
        options=(),
        *,
        user_after=None,
        cut=None,
        ask="Fix the failing tests.",
    ):
        tok, engine = family(self.name)
        task = " ".join([ask, plan_directive(plan), *map(option_directive, options)])
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task},
        ]
        for turn in range(len(plan)):
            planned = plan_token_prompt(
                tok, messages, TOOLS, self.states, kwargs=self.kwargs, policy=self.policy
            )
            written = engine.write(planned.prompt_ids, cut if turn == 0 else None)
            parsed = tok.parse_reply(written.output_ids, TOOLS, planned.prompt_ids)
            self.calls.append(Call(planned, written.output_ids, written.finish, parsed, messages))
            reply = reply_message(parsed, turn)
            self.states.append(
                TurnState(
                    seq=turn,
                    messages=list(messages),
                    reply=reply,
                    tools_key=tools_key(TOOLS, self.kwargs),
                    prompt=pack(planned.prompt_ids),
                    output=pack(written.output_ids),
                    base=planned.base.seq if planned.base is not None else None,
                )
            )
            messages = [*messages, reply, *answers(reply, turn, user=turn == user_after)]
        return self


def reply_message(parsed, turn: int) -> dict[str, Any]:
    """The assistant message the harness is answered with and echoes back (the ids the
    model wrote, where its format has them, as the proxy answers)."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [
            {
                "id": c.id or f"call{turn}x{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for i, c in enumerate(parsed.tool_calls)
        ]
    return message


def answers(reply: dict[str, Any], turn: int, *, user: bool) -> list[dict[str, Any]]:
    """What the harness sends after ``reply``: its tools' results, or a new user turn."""
    if user or not reply.get("tool_calls"):
        return [{"role": "user", "content": f"{reply_directive(turn)} Now also run the linter."}]
    return [
        {
            "role": "tool",
            "tool_call_id": c["id"],
            "content": f"{reply_directive(turn)} ok: 3 files ✓",
        }
        for c in reply["tool_calls"]
    ]


def official_ids(name: str, messages, kwargs) -> list[int]:
    """transformers' rendering, tokenized (arguments as mappings, as engines give them)."""
    _, engine = family(name)
    body = {"messages": messages, "tools": TOOLS, "chat_template_kwargs": kwargs}
    return engine.chat_prompt_ids(body)


def official_text(name: str, messages, kwargs) -> str:
    _, engine = family(name)
    return engine.tok.decode(official_ids(name, messages, kwargs), skip_special_tokens=False)


def assert_one_chain(s: Session) -> None:
    tok, _ = family(s.name)
    first = s.calls[0]
    assert first.plan.prompt_ids == official_ids(s.name, first.messages, s.kwargs)
    for before, call in zip(s.calls, s.calls[1:], strict=False):
        assert call.plan.extends is True, (s.name, call.plan.drift_reason)
        sampled = before.plan.prompt_ids + before.output
        assert call.plan.prompt_ids[: len(sampled)] == sampled
        # what is added is the template's own text for the new messages (and its turn
        # end where the output was cut off)
        added = tok.decode(call.plan.prompt_ids[len(sampled) :], skip_special_tokens=False)
        assert official_text(s.name, call.messages, s.kwargs).endswith(added), added


@pytest.mark.parametrize("name", FAMILIES)
def test_a_tool_loop_with_reasoning_is_one_chain(name):
    s = Session(name).run(["tool", "tool", "tool", "final"], ["unicode"])
    assert_one_chain(s)
    for call in s.calls[:3]:
        (parsed_call,) = call.parsed.tool_calls
        assert parsed_call.name == TOOL and "naïve café" in json.loads(parsed_call.arguments)["cmd"]
        assert call.parsed.failures == []
        assert bool(call.parsed.reasoning) == (name in REASONING)
    assert "All checks pass" in s.calls[3].parsed.content and not s.calls[3].parsed.tool_calls


@pytest.mark.parametrize("name", FAMILIES)
def test_a_new_user_turn_keeps_the_chain_under_keep_sampled(name):
    s = Session(name).run(["tool", "final", "tool", "final"], user_after=1)
    assert_one_chain(s)


@pytest.mark.parametrize(
    ("name", "cause"),
    [
        ("qwen3", "reasoning_dropped"),
        ("qwen3_5", "reasoning_dropped"),
        ("gpt_oss", "reasoning_dropped"),
        ("llama3_1", None),  # its template renders history as it was: nothing re-rendered
    ],
)
def test_rerender_names_why_the_chain_broke(name, cause):
    s = Session(name, policy=RERENDER).run(["tool", "final", "tool"], user_after=1)
    after_user = s.calls[2].plan
    assert s.calls[1].plan.extends is True  # tool results alone: appended as rendered
    assert after_user.extends is (cause is None) and after_user.drift_reason == cause
    if cause is not None:  # the prompt is the template's rendering of the whole history
        assert after_user.prompt_ids == official_ids(name, s.calls[2].messages, {})


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "deepseek_v3"])
def test_empty_reasoning_keeps_one_chain(name):
    s = Session(name).run(["tool", "tool", "final", "tool"], ["empty-reasoning"], user_after=2)
    assert_one_chain(s)
    assert all(not c.parsed.reasoning for c in s.calls)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "qwen3_6"])
def test_thinking_off_reaches_the_render_and_the_chain_holds(name):
    s = Session(name, kwargs={"enable_thinking": False}).run(
        ["tool", "final", "tool"], user_after=1
    )
    assert_one_chain(s)
    tok, _ = family(name)
    assert tok.decode(s.calls[0].plan.prompt_ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert all(not c.parsed.reasoning for c in s.calls)


@pytest.mark.parametrize("name", FAMILIES)
def test_truncated_output_is_closed_by_the_templates_turn_end(name):
    s = Session(name).run(["tool", "tool", "final"], cut=6)
    assert s.calls[0].finish == "length" and len(s.calls[0].output) == 6
    assert_one_chain(s)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in ONE_CALL_A_TURN])
def test_parallel_calls_parse_and_their_results_extend(name):
    s = Session(name).run(["parallel", "tool", "final"])
    assert [c.name for c in s.calls[0].parsed.tool_calls] == [TOOL, TOOL]
    assert_one_chain(s)


@pytest.mark.parametrize("name", FAMILIES)
def test_malformed_markup_is_a_failure_with_its_token_span(name):
    s = Session(name).run(["malformed", "tool", "final"])
    (failure,) = s.calls[0].parsed.failures
    assert failure.kind == "malformed" and 0 <= failure.start < failure.end <= len(
        s.calls[0].output
    )
    assert not s.calls[0].parsed.tool_calls
    assert s.calls[1].parsed.failures == [] and s.calls[1].plan.extends is True


# -- chat mode: the engine renders, the proxy says why a prompt did not extend --------
def chat_prompt(name: str, messages) -> list[int]:
    """The prompt as an engine templates it (vLLM and SGLang parse arguments first)."""
    return official_ids(name, messages, {})


def chat_state(tok, messages, reply, prompt, output) -> TurnState:
    return TurnState(
        seq=0, messages=messages, reply=reply, tools_key=tools_key(TOOLS),
        prompt=pack(prompt), output=pack(output),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "reason"),
    [("qwen3", None), ("qwen3_5", None), ("llama3_1", None), ("gpt_oss", "response_retokenized")],
)
def test_chat_mode_on_real_bpe_extends_where_the_engine_renders_what_was_sampled(name, reason):
    """Tool results after a tool call: the engine renders the echoed call as sampled;
    gpt-oss's template writes a call's header in another order than the model does
    (``to=functions.x<|channel|>commentary json`` for ``<|channel|>commentary
    to=functions.x <|constrain|>json``) and its JSON with spaces: the answer is
    re-rendered (token mode keeps what was sampled)."""
    tok, engine = family(name)
    s = Session(name).run(["tool", "tool"])
    first = s.calls[0]
    prompt = chat_prompt(name, first.messages)
    state = chat_state(tok, first.messages, s.states[0].reply, prompt, first.output)
    later = s.calls[1].messages
    judged = judge_chat_prompt(chat_prompt(name, later), later, TOOLS, [state], decode=tok.decode)
    assert judged.extends is (reason is None) and judged.drift_reason == reason


def drift(
    name: str, sampled_text: str, echoed: dict[str, Any], sampled_ids=None, follow: str = "user"
) -> str | None:
    """The reason judge_chat_prompt gives when the model sampled ``sampled_text`` (as
    ``sampled_ids`` if given), the harness echoed ``echoed`` and then sent a new user
    turn (``follow="tool"``: the result of its first call)."""
    tok, _ = family(name)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hi."}]
    prompt = chat_prompt(name, messages)
    output = sampled_ids or tok.encode(sampled_text)
    parsed = tok.parse_reply(output, TOOLS, prompt)
    state = chat_state(tok, messages, reply_message(parsed, 0), prompt, output)
    after = (
        {"role": "tool", "tool_call_id": echoed["tool_calls"][0]["id"], "content": "total 0"}
        if follow == "tool"
        else {"role": "user", "content": "And again."}
    )
    later = [*messages, echoed, after]
    return judge_chat_prompt(
        chat_prompt(name, later), later, TOOLS, [state], decode=tok.decode
    ).drift_reason


def test_chat_mode_drift_reasons_on_real_bpe():
    # Qwen3 drops the reasoning of a turn before the last user turn, the answer kept
    answer = "Hi there! How can I help you with the repository today?"
    think = f"<think>\nThe user wants a greeting.\n</think>\n\n{answer}<|im_end|>"
    echo = {
        "role": "assistant",
        "content": answer,
        "reasoning_content": "The user wants a greeting.",
    }
    assert drift("qwen3", think, echo) == "reasoning_dropped"
    # ... and so does a client that does not send the reasoning back
    assert drift("qwen3", think, {"role": "assistant", "content": answer}) == "reasoning_dropped"
    # a client that strips the answer's trailing whitespace changed the text the model
    # wrote (Llama's template renders the history as it is sent)
    spaced = "Hi there!  \n<|eot_id|>"
    echo = {"role": "assistant", "content": "Hi there!"}
    assert drift("llama3_1", spaced, echo) == "assistant_text_changed"
    # the same text sampled as other tokens than the tokenizer's own (a merge boundary:
    # " there" sampled as " the" + "re"): the engine re-tokenizes it
    tok, _ = family("llama3_1")
    pieces = [tok.encode(p) for p in ("Hi", " the", "re", "!")]
    ids = [i for p in pieces for i in p] + [tok.tokenizer.token_to_id("<|eot_id|>")]
    assert tok.encode("Hi there!") != ids[:-1]  # not the canonical tokenization
    echo = {"role": "assistant", "content": "Hi there!"}
    assert drift("llama3_1", "", echo, sampled_ids=ids) == "response_retokenized"
    # unicode: an emoji's four bytes sampled a byte token at a time
    rocket = [tok.tokenizer.token_to_id(BYTE_TOKENS[b]) for b in "🚀".encode()]
    eot = tok.tokenizer.token_to_id("<|eot_id|>")
    assert tok.decode(rocket) == "🚀" and tok.encode("🚀") != rocket
    echo = {"role": "assistant", "content": "🚀"}
    assert drift("llama3_1", "", echo, sampled_ids=[*rocket, eot]) == "response_retokenized"


def _byte_tokens() -> dict[int, str]:
    """Byte-level BPE's character for each byte (GPT-2's table): a byte's own token."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table


BYTE_TOKENS = _byte_tokens()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_no_think_in_the_user_turn_keeps_one_chain(name):
    """Qwen3's soft switch: the user writes /no_think, the model answers with an empty
    think block (the template knows nothing of it: what was sampled is kept)."""
    ask = "Fix the failing tests. /no_think"
    s = Session(name).run(["tool", "final", "tool"], ["empty-reasoning"], user_after=1, ask=ask)
    assert "/no_think" in family(name)[0].decode(s.calls[0].plan.prompt_ids)
    assert_one_chain(s)


def test_chat_mode_names_a_rerendered_history():
    # DeepSeek's generation prompt opens <think>, which its rendering of the same turn in
    # the history leaves out: the prompt departs inside the earlier call's own prompt
    name = "deepseek_v3"
    call = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>exec_command<｜tool▁sep｜>{"cmd": "ls -la"}'
    sampled = f"</think>{call}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    fn = {"name": TOOL, "arguments": '{"cmd": "ls -la"}'}
    echo = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": fn}],
    }
    assert drift(name, sampled, echo, follow="tool") == "history_rerendered"
    # Qwen3.5 writes an earlier turn without its (here empty) think block once a new user
    # turn follows: the prompt departs inside the earlier call's own prompt
    spaced = "\n</think>\n\nHi there!<|im_end|>"
    assert (
        drift("qwen3_5", spaced, {"role": "assistant", "content": "Hi there!"})
        == "history_rerendered"
    )
