import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.tokenization.families.llama import FAMILY, parse_llama
from services.common.tokenization.toolcalls import ParsedReply, ParsedToolCall, ToolCallFailure
from tests.unit.common.tokenization.families import WEATHER_ASK, WEATHER_TOOLS, official_turn

HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"
TOOLS, USER = WEATHER_TOOLS, WEATHER_ASK


def model_text(template: str, calls: list[dict]) -> str:
    """The reply as the model writes it: the official template's turn, header and
    <|eot_id|> removed (the prompt wrote one, the engine stripped the other)."""
    turn = official_turn(template, FAMILY, USER, {"role": "assistant", "tool_calls": calls}, TOOLS)
    assert turn.startswith(HEADER) and turn.endswith("<|eot_id|>")
    return turn.removeprefix(HEADER).removesuffix("<|eot_id|>")


@pytest.mark.parametrize("template", ["llama3_1.jinja", "llama3_2.jinja"])
def test_official_template_tool_call_parses(template):
    args = '{"city": "東京", "opts": {"units": ["°C"], "days": 2}}'
    text = model_text(template, [{"function": {"name": "get_weather", "arguments": args}}])
    assert text == '{"name": "get_weather", "parameters": ' + args + "}"
    assert parse_llama(text, TOOLS) == ParsedReply(
        content="",
        reasoning=None,
        tool_calls=[ParsedToolCall("get_weather", args)],
        errors=[],
        failures=[],
    )


def test_python_tag_and_parallel_calls_with_either_key():
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'
    )
    reply = parse_llama(text)
    assert reply.tool_calls == [
        ParsedToolCall("get_weather", '{"city": "Paris"}'),
        ParsedToolCall("get_time", '{"tz": "Europe/Paris"}'),
    ]
    assert (reply.content, reply.errors, reply.failures) == ("", [], [])


def test_text_before_the_tag_and_after_the_calls_is_content():
    text = 'Let me check.\n<|python_tag|>{"name": "get_weather", "parameters": {}}\nOne moment.'
    reply = parse_llama(text)
    assert reply.content == "Let me check.\nOne moment."
    assert reply.tool_calls == [ParsedToolCall("get_weather", "{}")]


def test_plain_text_is_content():
    text = "It is sunny in Paris today.\n"
    assert parse_llama(text) == ParsedReply(
        content=text, reasoning=None, tool_calls=[], errors=[], failures=[]
    )


def test_a_json_answer_that_is_not_a_call_is_content():
    for text in ('{"answer": 42}', '{"name": "Ada", "born": 1815}', "{not json, just braces}"):
        assert parse_llama(text) == ParsedReply(
            content=text, reasoning=None, tool_calls=[], errors=[], failures=[]
        )


def test_malformed_second_call_stays_in_content_with_its_span():
    good = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    bad = '{"name": "get_time", "parameters": {"tz": Europe}}'
    text = f"{good}; {bad}"
    reply = parse_llama(text)
    assert reply.tool_calls == [ParsedToolCall("get_weather", '{"city": "Paris"}')]
    assert reply.content == bad
    detail = "tool call is not valid JSON: Expecting value (character 42)"
    assert reply.errors == [detail]
    assert reply.failures == [ToolCallFailure("malformed", detail, len(good) + 2, len(text))]
    assert text[reply.failures[0].start : reply.failures[0].end] == bad


def test_truncated_call_is_a_failure_and_the_text_stays_content():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Par'
    reply = parse_llama(text)
    assert reply.tool_calls == []
    assert reply.content == text
    detail = "tool call is not valid JSON: Unterminated string starting at (character 47)"
    assert reply.failures == [ToolCallFailure("malformed", detail, 14, len(text))]
    assert reply.errors == [detail]


def test_call_without_a_name_is_a_failure():
    text = '<|python_tag|>{"parameters": {"city": "Paris"}}'
    reply = parse_llama(text)
    detail = "tool call JSON must be an object with a non-empty string 'name'"
    assert reply.failures == [ToolCallFailure("malformed", detail, 14, len(text))]
    assert reply.content == text and reply.tool_calls == []


def test_builtin_tool_code_after_the_tag_is_a_failure():
    text = '<|python_tag|>brave_search.call(query="weather Paris")'
    reply = parse_llama(text)
    detail = "no JSON tool call after <|python_tag|>"
    assert reply.failures == [ToolCallFailure("malformed", detail, 14, len(text))]
    assert reply.content == text


def test_string_arguments_and_unicode_are_kept_verbatim():
    text = (
        '{"name": "say", "parameters": "{\\"text\\": \\"héllo 日本\\", \\"n\\": {\\"k\\": [1]}}"}'
    )
    (call,) = parse_llama(text).tool_calls
    assert call == ParsedToolCall("say", '{"text": "héllo 日本", "n": {"k": [1]}}')


def test_family_settings():
    assert (FAMILY.name, FAMILY.parse, FAMILY.turn_ends) == (
        "llama3",
        parse_llama,
        ("<|eot_id|>", "<|eom_id|>"),
    )
    assert FAMILY.reasoning_open("<|start_header_id|>assistant<|end_header_id|>\n\n") is False
    assert FAMILY.template_kwargs(None) == {}


scalars = st.one_of(st.integers(-(10**6), 10**6), st.text(max_size=20), st.booleans(), st.none())
arguments = st.dictionaries(st.text(min_size=1, max_size=10), scalars, max_size=4)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True)


@settings(max_examples=40, deadline=None)
@given(name=names, args=arguments)
def test_what_the_template_writes_parses_back(name, args):
    text = model_text("llama3_1.jinja", [{"function": {"name": name, "arguments": args}}])
    assert parse_llama(text).tool_calls == [
        ParsedToolCall(name, json.dumps(args, ensure_ascii=False))
    ]
