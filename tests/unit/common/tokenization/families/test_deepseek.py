import json

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.tokenization.families.deepseek import FAMILY, parse_deepseek
from services.common.tokenization.toolcalls import ParsedReply, ParsedToolCall, ToolCallFailure
from tests.unit.common.tokenization.families import official_turn

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
ASSISTANT, EOS = "<｜Assistant｜>", "<｜end▁of▁sentence｜>"
USER = [{"role": "user", "content": "Weather in Tokyo and Paris?"}]
ARGS = '{"city": "東京", "opts": {"units": ["°C"], "days": 2}}'


def v31_call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


def model_text(calls: list[tuple[str, str]]) -> str:
    """A V3 tool-calling turn as the official template writes it (arguments as text: the
    family keeps them so), without the assistant tag and the end of sentence."""
    reply = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
        ],
    }
    turn = official_turn("deepseekv3.jinja", FAMILY, USER, reply)
    assert turn.startswith(ASSISTANT) and turn.endswith(EOS)
    return turn.removeprefix(ASSISTANT).removesuffix(EOS)


def test_official_v3_template_parallel_calls_parse():
    text = model_text([("get_weather", ARGS), ("get_weather", '{"city": "Paris"}')])
    assert text == (
        f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{ARGS}\n```{CALL_END}\n"
        f'{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{CALL_END}'
        f"{CALLS_END}"
    )
    assert parse_deepseek(text) == ParsedReply(
        content="",
        reasoning=None,
        tool_calls=[
            ParsedToolCall("get_weather", ARGS),
            ParsedToolCall("get_weather", '{"city": "Paris"}'),
        ],
        errors=[],
        failures=[],
    )


def test_v31_calls_with_text_before_them():
    text = (
        "Let me look both up.\n\n"
        f"{CALLS_BEGIN}{v31_call('get_weather', ARGS)}{v31_call('get_time', '{}')}{CALLS_END}"
    )
    assert parse_deepseek(text) == ParsedReply(
        content="Let me look both up.",
        reasoning=None,
        tool_calls=[ParsedToolCall("get_weather", ARGS), ParsedToolCall("get_time", "{}")],
        errors=[],
        failures=[],
    )


def test_v31_thinking_output_opens_inside_the_reasoning():
    reply = parse_deepseek("The user wants a greeting.</think>Hello!", reasoning_open=True)
    assert (reply.reasoning, reply.content) == ("The user wants a greeting.", "Hello!")


def test_thinking_then_tool_call():
    text = f"Need the weather.</think>{CALLS_BEGIN}{v31_call('get_weather', ARGS)}{CALLS_END}"
    assert parse_deepseek(text, reasoning_open=True) == ParsedReply(
        content="",
        reasoning="Need the weather.",
        tool_calls=[ParsedToolCall("get_weather", ARGS)],
        errors=[],
        failures=[],
    )


def test_reasoning_cut_off_by_length_is_all_reasoning():
    assert parse_deepseek("Step 1: consider", reasoning_open=True) == ParsedReply(
        content="", reasoning="Step 1: consider", tool_calls=[], errors=[], failures=[]
    )


def test_empty_reasoning():
    reply = parse_deepseek("</think>Hi.", reasoning_open=True)
    assert (reply.reasoning, reply.content) == ("", "Hi.")


def test_thinking_off_is_content_only():
    assert parse_deepseek("Hello there.") == ParsedReply(
        content="Hello there.", reasoning=None, tool_calls=[], errors=[], failures=[]
    )


def test_malformed_call_stays_in_content_with_its_span():
    bad = v31_call("get_weather", '{"city": Paris}')
    text = f"{CALLS_BEGIN}{bad}{v31_call('get_time', '{}')}{CALLS_END}"
    reply = parse_deepseek(text)
    detail = "tool call arguments are not valid JSON: Expecting value (character 9)"
    start = len(CALLS_BEGIN)
    assert reply == ParsedReply(
        content=bad,
        reasoning=None,
        tool_calls=[ParsedToolCall("get_time", "{}")],
        errors=[detail],
        failures=[ToolCallFailure("malformed", detail, start, start + len(bad))],
    )
    assert text[start : start + len(bad)] == bad


def test_truncated_call_is_a_failure_and_the_text_stays_content():
    head = f"Checking.</think>{CALLS_BEGIN}"
    cut = f'{CALL_BEGIN}get_weather{SEP}{{"city": "Pa'
    reply = parse_deepseek(head + cut, reasoning_open=True)
    detail = "unterminated tool call (no <｜tool▁call▁end｜>)"
    assert reply == ParsedReply(
        content=CALLS_BEGIN + cut,
        reasoning="Checking.",
        tool_calls=[],
        errors=[detail],
        failures=[ToolCallFailure("malformed", detail, len(head), len(head + cut))],
    )


def test_call_without_separator_is_a_failure():
    bad = f"{CALL_BEGIN}get_weather{CALL_END}"
    reply = parse_deepseek(f"{CALLS_BEGIN}{bad}{CALLS_END}")
    detail = "tool call has no <｜tool▁sep｜> after its name"
    start = len(CALLS_BEGIN)
    assert reply.failures == [ToolCallFailure("malformed", detail, start, start + len(bad))]
    assert reply.tool_calls == []


def test_text_after_the_calls_is_kept():
    text = f"{CALLS_BEGIN}{v31_call('get_time', '{}')}{CALLS_END}\nDone."
    reply = parse_deepseek(text)
    assert (reply.content, reply.tool_calls) == ("Done.", [ParsedToolCall("get_time", "{}")])


def test_family_settings():
    assert (FAMILY.name, FAMILY.parse, FAMILY.turn_ends) == (
        "deepseek_v3",
        parse_deepseek,
        ("<｜end▁of▁sentence｜>",),
    )
    assert FAMILY.reasoning_open("<｜User｜>hi<｜Assistant｜><think>") is True
    assert FAMILY.reasoning_open("<｜User｜>hi<｜Assistant｜><think>\n") is True
    assert FAMILY.reasoning_open("<｜User｜>hi<｜Assistant｜></think>") is False

    class Reasoning:
        enabled, effort = None, "medium"

    assert FAMILY.template_kwargs(Reasoning()) == {"thinking": True}
    # the official templates concatenate the arguments text: it must stay text
    call = {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert FAMILY.prepare([{"role": "assistant", "tool_calls": [call]}])[0]["tool_calls"] == [call]


scalars = st.one_of(st.integers(-(10**6), 10**6), st.text(max_size=20), st.booleans(), st.none())
arguments = st.dictionaries(st.text(min_size=1, max_size=10), scalars, max_size=4)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True)


@settings(max_examples=40, deadline=None)
@given(calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=3))
def test_what_the_template_writes_parses_back(calls):
    as_text = [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    assert parse_deepseek(model_text(as_text)).tool_calls == [
        ParsedToolCall(n, a) for n, a in as_text
    ]
