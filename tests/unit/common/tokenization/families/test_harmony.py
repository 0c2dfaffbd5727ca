import json

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.tokenization.families.base import check_calls
from services.common.tokenization.families.harmony import FAMILY, parse_harmony
from services.common.tokenization.toolcalls import ParsedReply, ParsedToolCall, ToolCallFailure
from tests.unit.common.tokenization.families import WEATHER_ASK, WEATHER_TOOLS, official_turn

PROMPT_END = "<|start|>assistant"  # the generation prompt: the output continues it
TOOLS, USER = WEATHER_TOOLS, WEATHER_ASK
ARGS = '{"city": "東京", "opts": {"units": ["°C"], "days": 2}}'


def model_text(reply: dict, turn_end: str) -> str:
    """The reply as gpt-oss writes it: the official template's turn without the prompt's
    ``<|start|>assistant`` and the closing token the engine stopped on."""
    turn = official_turn("gptoss.jinja", FAMILY, USER, reply, TOOLS)
    assert turn.startswith(PROMPT_END) and turn.endswith(turn_end)
    return turn.removeprefix(PROMPT_END).removesuffix(turn_end)


def test_official_template_tool_call_turn_parses():
    call = {"type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    reply = {"role": "assistant", "reasoning_content": "Need the weather.", "tool_calls": [call]}
    text = model_text(reply, "<|call|>")
    # the recipient before the channel, a bare content type: how the template writes it
    assert text == (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>" + ARGS
    )
    assert parse_harmony(text, TOOLS) == ParsedReply(
        content="",
        reasoning="Need the weather.",
        tool_calls=[ParsedToolCall("get_weather", ARGS)],
        errors=[],
        failures=[],
    )


def test_official_template_final_answer_turn_parses():
    reply = {"role": "assistant", "reasoning_content": "Easy one.", "content": "Sunny, 21°C."}
    text = model_text(reply, "<|return|>")
    assert parse_harmony(text) == ParsedReply(
        content="Sunny, 21°C.", reasoning="Easy one.", tool_calls=[], errors=[], failures=[]
    )


def test_call_with_recipient_after_the_channel_and_constrain():
    text = (
        "<|channel|>analysis<|message|>User wants weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris"}'
    )
    reply = parse_harmony(text, TOOLS)
    assert reply.tool_calls == [ParsedToolCall("get_weather", '{"city": "Paris"}')]
    assert (reply.reasoning, reply.content, reply.failures) == ("User wants weather.", "", [])


def test_preamble_is_content_and_several_calls_are_read():
    text = (
        "<|channel|>analysis<|message|>Two cities.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking both cities.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Lyon"}'
    )
    assert parse_harmony(text, TOOLS) == ParsedReply(
        content="Checking both cities.",
        reasoning="Two cities.",
        tool_calls=[
            ParsedToolCall("get_weather", '{"city": "Paris"}'),
            ParsedToolCall("get_weather", '{"city": "Lyon"}'),
        ],
        errors=[],
        failures=[],
    )


def test_analysis_and_final_messages_are_joined_by_newlines():
    text = (
        "<|channel|>analysis<|message|>first<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>second<|end|>"
        "<|start|>assistant<|channel|>final<|message|>one<|end|>"
        "<|start|>assistant<|channel|>final<|message|>two"
    )
    reply = parse_harmony(text)
    assert (reply.reasoning, reply.content) == ("first\nsecond", "one\ntwo")


def test_empty_reasoning_and_no_reasoning():
    empty = parse_harmony(
        "<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|>Hi"
    )
    assert (empty.reasoning, empty.content) == ("", "Hi")
    none = parse_harmony("<|channel|>final<|message|>Hi")
    assert (none.reasoning, none.content) == (None, "Hi")


def test_output_cut_off_in_analysis_is_reasoning():
    assert parse_harmony("<|channel|>analysis<|message|>The user asks abo") == ParsedReply(
        content="", reasoning="The user asks abo", tool_calls=[], errors=[], failures=[]
    )


def test_output_cut_off_in_a_header_drops_the_header():
    text = "<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>fin"
    assert parse_harmony(text) == ParsedReply(
        content="", reasoning="Done.", tool_calls=[], errors=[], failures=[]
    )


def test_truncated_call_json_is_a_failure_with_its_markup_in_content():
    head = "<|channel|>analysis<|message|>Need weather.<|end|>"
    call = (
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Par'
    )
    reply = parse_harmony(head + call, TOOLS)
    detail = "tool call arguments are not valid JSON: Unterminated string starting at (character 9)"
    assert reply == ParsedReply(
        content=call,
        reasoning="Need weather.",
        tool_calls=[],
        errors=[detail],
        failures=[ToolCallFailure("malformed", detail, len(head), len(head + call))],
    )


def test_call_cut_off_before_its_arguments_is_a_failure():
    text = "<|channel|>commentary to=functions.get_wea"
    detail = "tool call to functions.get_wea ends before its arguments"
    assert parse_harmony(text) == ParsedReply(
        content=text,
        reasoning=None,
        tool_calls=[],
        errors=[detail],
        failures=[ToolCallFailure("malformed", detail, 0, len(text))],
    )


def test_bad_json_in_a_finished_call_spans_up_to_its_call_token():
    bad = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{city: Paris}<|call|>"
    good = '<|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Nice"}'
    reply = parse_harmony(bad + good)
    detail = "tool call arguments are not valid JSON: Expecting property name enclosed in double quotes (character 1)"
    assert reply.failures == [ToolCallFailure("malformed", detail, 0, len(bad))]
    assert reply.content == bad
    assert reply.tool_calls == [ParsedToolCall("get_weather", '{"city": "Nice"}')]


def test_arguments_that_are_not_an_object_are_a_failure():
    text = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>[1, 2]"
    reply = parse_harmony(text)
    detail = "tool call arguments must be a JSON object"
    assert reply.failures == [ToolCallFailure("malformed", detail, 0, len(text))]
    assert (reply.content, reply.tool_calls) == (text, [])


def test_builtin_recipient_is_a_call_the_checks_report_as_unknown():
    text = '<|channel|>analysis to=browser.search code<|message|>{"query": "weather"}'
    reply = check_calls(parse_harmony(text, TOOLS), TOOLS)
    assert reply.tool_calls == [ParsedToolCall("browser.search", '{"query": "weather"}')]
    assert reply.failures == [
        ToolCallFailure("unknown_tool", "no tool named 'browser.search'", -1, -1)
    ]


def test_text_without_harmony_markup_is_content():
    assert parse_harmony("Just text.") == ParsedReply(
        content="Just text.", reasoning=None, tool_calls=[], errors=[], failures=[]
    )


def test_family_settings():
    assert (FAMILY.name, FAMILY.parse, FAMILY.reasoning_key) == (
        "gpt_oss",
        parse_harmony,
        "thinking",
    )
    assert FAMILY.turn_ends == ("<|end|>", "<|call|>", "<|return|>")

    class Reasoning:
        enabled, effort = None, "xhigh"

    assert FAMILY.template_kwargs(Reasoning()) == {"reasoning_effort": "high"}
    (prepared,) = FAMILY.prepare([{"role": "assistant", "reasoning_content": "r", "content": ""}])
    assert prepared == {"role": "assistant", "thinking": "r", "content": ""}


# Text holding harmony's markup itself ("<|start|>") decodes exactly as the special token
# does: the model writes the token, a text parser cannot tell them apart (vLLM's harmony
# parser reads ids); the arguments here are text without it.
plain_text = st.text(st.characters(blacklist_characters="<"), max_size=20)
scalars = st.one_of(st.integers(-(10**6), 10**6), plain_text, st.booleans(), st.none())
arguments = st.dictionaries(
    st.text(st.characters(blacklist_characters="<"), min_size=1, max_size=10), scalars, max_size=4
)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True)
thoughts = st.text(st.characters(blacklist_characters="<"), max_size=40)


@settings(max_examples=40, deadline=None)
@given(name=names, args=arguments, thinking=thoughts)
def test_what_the_template_writes_parses_back(name, args, thinking):
    call = {"type": "function", "function": {"name": name, "arguments": args}}
    reply = {"role": "assistant", "reasoning_content": thinking, "tool_calls": [call]}
    parsed = parse_harmony(model_text(reply, "<|call|>"))
    assert parsed.tool_calls == [ParsedToolCall(name, json.dumps(args, ensure_ascii=False))]
    assert parsed.reasoning == (thinking or None)
