"""Texts in the shapes mistral-common decodes (``tokens/tokenizers/tools.py``): v11+
``[TOOL_CALLS]name[ARGS]{...}`` (with or without ``[CALL_ID]``), v2-v7 ``[TOOL_CALLS][...]``,
and Magistral's ``[THINK]...[/THINK]``."""

from services.common.tokenization.families.mistral import FAMILY, parse_mistral
from services.common.tokenization.toolcalls import ParsedReply, ParsedToolCall, ToolCallFailure

ARGS = '{"city": "東京", "opts": {"units": ["°C"], "days": 2}}'


def test_v11_parallel_calls_with_text_before_them():
    text = f"Checking both.[TOOL_CALLS]get_weather[ARGS]{ARGS}[TOOL_CALLS]get_time[ARGS]{{}}"
    assert parse_mistral(text) == ParsedReply(
        content="Checking both.",
        reasoning=None,
        tool_calls=[ParsedToolCall("get_weather", ARGS), ParsedToolCall("get_time", "{}")],
        errors=[],
        failures=[],
    )


def test_v11_call_with_a_call_id():
    text = '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}'
    assert parse_mistral(text).tool_calls == [ParsedToolCall("get_weather", '{"city": "Paris"}')]


def test_name_directly_followed_by_arguments():
    # what a decode that skips the [ARGS] special token leaves
    assert parse_mistral('[TOOL_CALLS]get_weather{"city": "Paris"}').tool_calls == [
        ParsedToolCall("get_weather", '{"city": "Paris"}')
    ]


def test_v2_to_v7_json_list():
    text = (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}, '
        '{"name": "get_time", "arguments": {}}]'
    )
    assert parse_mistral(text) == ParsedReply(
        content="",
        reasoning=None,
        tool_calls=[
            ParsedToolCall("get_weather", '{"city": "Paris"}', id="a1B2c3D4e"),  # the model's id
            ParsedToolCall("get_time", "{}"),
        ],
        errors=[],
        failures=[],
    )


def test_magistral_reasoning_then_call():
    text = f"[THINK]The user wants the weather.[/THINK][TOOL_CALLS]get_weather[ARGS]{ARGS}"
    assert parse_mistral(text) == ParsedReply(
        content="",
        reasoning="The user wants the weather.",
        tool_calls=[ParsedToolCall("get_weather", ARGS)],
        errors=[],
        failures=[],
    )


def test_magistral_reasoning_then_answer_and_empty_reasoning():
    reply = parse_mistral("[THINK]Simple.[/THINK]It is 21°C.")
    assert (reply.reasoning, reply.content) == ("Simple.", "It is 21°C.")
    empty = parse_mistral("[THINK][/THINK]Hi.")
    assert (empty.reasoning, empty.content) == ("", "Hi.")


def test_reasoning_cut_off_by_length_is_all_reasoning():
    assert parse_mistral("[THINK]First, the city") == ParsedReply(
        content="", reasoning="First, the city", tool_calls=[], errors=[], failures=[]
    )


def test_prompt_that_opened_the_reasoning():
    reply = parse_mistral("Plan.[/THINK]Answer.", reasoning_open=True)
    assert (reply.reasoning, reply.content) == ("Plan.", "Answer.")


def test_content_only():
    assert parse_mistral("Bonjour !") == ParsedReply(
        content="Bonjour !", reasoning=None, tool_calls=[], errors=[], failures=[]
    )


def test_malformed_second_call_stays_in_content_with_its_span():
    good = f"[TOOL_CALLS]get_weather[ARGS]{ARGS}"
    bad = "[TOOL_CALLS]get_time[ARGS]{tz: UTC}"
    reply = parse_mistral(good + bad)
    detail = "tool call is not valid JSON: Expecting property name enclosed in double quotes (character 1)"
    assert reply == ParsedReply(
        content=bad,
        reasoning=None,
        tool_calls=[ParsedToolCall("get_weather", ARGS)],
        errors=[detail],
        failures=[ToolCallFailure("malformed", detail, len(good), len(good + bad))],
    )


def test_truncated_call_after_reasoning_is_a_failure():
    head = "[THINK]Need weather.[/THINK]"
    cut = '[TOOL_CALLS]get_weather[ARGS]{"city": "Par'
    reply = parse_mistral(head + cut)
    detail = "tool call is not valid JSON: Unterminated string starting at (character 9)"
    assert reply == ParsedReply(
        content=cut,
        reasoning="Need weather.",
        tool_calls=[],
        errors=[detail],
        failures=[ToolCallFailure("malformed", detail, len(head), len(head + cut))],
    )


def test_call_without_arguments_or_name_is_a_failure():
    no_args = parse_mistral("[TOOL_CALLS]get_weather")
    detail = "tool call has no [ARGS] after its name"
    assert no_args.failures == [ToolCallFailure("malformed", detail, 0, 23)]
    no_name = parse_mistral("[TOOL_CALLS][ARGS]{}")
    assert no_name.errors == ["tool call function name is empty"]
    assert no_name.content == "[TOOL_CALLS][ARGS]{}"


def test_json_list_with_a_bad_entry_is_one_failure():
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"arguments": {}}]'
    detail = "tool call JSON must be an object with a non-empty string 'name'"
    assert parse_mistral(text) == ParsedReply(
        content=text,
        reasoning=None,
        tool_calls=[],
        errors=[detail],
        failures=[ToolCallFailure("malformed", detail, 0, len(text))],
    )


def test_arguments_that_are_not_an_object_are_a_failure():
    reply = parse_mistral("[TOOL_CALLS]get_time[ARGS]null")
    assert reply.errors == ["tool call arguments must be a JSON object"]
    assert reply.tool_calls == []


def test_family_settings():
    assert (FAMILY.name, FAMILY.parse, FAMILY.turn_ends) == ("mistral", parse_mistral, ("</s>",))
    assert FAMILY.template_kwargs(None) == {}
