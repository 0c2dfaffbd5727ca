"""What every family shares: messages as templates read them, reasoning settings as
template variables, and the checks of parsed tool calls against the offered tools."""

import json

import pytest

from proxy.conversation import Reasoning
from services.common.tokenization.families import (
    FAMILIES,
    UnknownFamilyError,
    detect_family,
    family_for,
    family_named,
)
from services.common.tokenization.families.base import check_calls, schema_problem
from services.common.tokenization.toolcalls import ParsedReply, ParsedToolCall

CALL = {"id": "c1", "type": "function", "function": {"name": "sh", "arguments": '{"cmd": "ls"}'}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "sh",
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}},
                "required": ["cmd"],
            },
        },
    }
]


def test_arguments_reach_the_template_as_mappings_and_the_input_is_untouched():
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
    ]
    prepared = FAMILIES["qwen3_5"].prepare(messages)
    assert prepared[1]["tool_calls"][0]["function"]["arguments"] == {"cmd": "ls"}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"cmd": "ls"}'
    assert prepared[0] is messages[0]  # what needs nothing is passed through


def test_arguments_that_are_not_a_json_object_stay_text():
    bad = {"id": "c", "type": "function", "function": {"name": "sh", "arguments": "not json"}}
    listed = {"id": "c", "type": "function", "function": {"name": "sh", "arguments": "[1]"}}
    out = FAMILIES["qwen3"].prepare([{"role": "assistant", "tool_calls": [bad, listed]}])
    assert [c["function"]["arguments"] for c in out[0]["tool_calls"]] == ["not json", "[1]"]


def test_polar_chatml_keeps_argument_text_as_the_model_wrote_it():
    messages = [{"role": "assistant", "content": "", "tool_calls": [CALL]}]
    assert FAMILIES["polar_chatml"].prepare(messages) is messages


def test_gpt_oss_reads_reasoning_as_thinking():
    msg = {"role": "assistant", "content": "4", "reasoning_content": "2+2"}
    (out,) = FAMILIES["gpt_oss"].prepare([msg])
    assert out["thinking"] == "2+2" and "reasoning_content" not in out


@pytest.mark.parametrize(
    ("family", "reasoning", "explicit", "expected"),
    [
        ("qwen3", Reasoning(enabled=False), None, {"enable_thinking": False}),  # Anthropic disabled
        ("qwen3", Reasoning(enabled=True, budget_tokens=512), None, {"enable_thinking": True}),
        ("qwen3_5", Reasoning(effort="none"), None, {"enable_thinking": False}),  # OpenAI "none"
        ("qwen3_5", Reasoning(effort="high"), None, {"enable_thinking": True}),
        ("qwen3", None, {"enable_thinking": False}, {"enable_thinking": False}),
        ("qwen3", Reasoning(enabled=True), {"enable_thinking": False}, {"enable_thinking": False}),
        ("gpt_oss", Reasoning(effort="medium"), None, {"reasoning_effort": "medium"}),
        ("gpt_oss", Reasoning(effort="xhigh"), None, {"reasoning_effort": "high"}),
        ("gpt_oss", Reasoning(effort="minimal"), None, {"reasoning_effort": "low"}),
        ("gpt_oss", Reasoning(enabled=False), None, {}),  # gpt-oss always reasons
        ("deepseek_v3", Reasoning(enabled=True), None, {"thinking": True}),
        ("polar_chatml", Reasoning(effort="high"), None, {}),
        ("qwen3", None, None, {}),
    ],
)
def test_reasoning_settings_become_the_familys_template_variables(
    family, reasoning, explicit, expected
):
    assert FAMILIES[family].template_kwargs(reasoning, explicit) == expected


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ('{"cmd": "ls"}', None),
        ('{"cmd": "ls", "timeout": 5}', None),
        ('{"timeout": 5}', "missing required cmd"),
        ('{"cmd": 3}', "'cmd' is not of type string"),
        ('{"cmd": "ls", "timeout": true}', "'timeout' is not of type integer"),
        ('{"cmd": "ls", "timeout": 1.5}', "'timeout' is not of type integer"),
        ("[1]", "arguments are not a JSON object"),
        ("{", "arguments are not JSON"),
    ],
)
def test_schema_problems(arguments, problem):
    assert schema_problem(arguments, TOOLS[0]["function"]["parameters"]) == problem


def test_unknown_tools_and_bad_arguments_are_failures_but_the_calls_stay():
    parsed = ParsedReply(
        content="",
        reasoning=None,
        tool_calls=[
            ParsedToolCall("sh", json.dumps({"cmd": "ls"})),
            ParsedToolCall("rm_rf", "{}"),
            ParsedToolCall("sh", "{}"),
        ],
        errors=[],
    )
    checked = check_calls(parsed, TOOLS)
    assert [(f.kind, f.detail) for f in checked.failures] == [
        ("unknown_tool", "no tool named 'rm_rf'"),
        ("invalid_arguments", "sh: missing required cmd"),
    ]
    assert checked.tool_calls == parsed.tool_calls
    assert check_calls(parsed, None) is parsed  # no tools offered: nothing to check against


@pytest.mark.parametrize(
    ("template", "config", "name"),
    [
        ("{{ '<|channel|>' }}", {}, "gpt_oss"),
        ("<tool_call> <function= <parameter= <|im_start|>", {}, "qwen3_5"),
        ("<tool_call> <|im_start|>", {}, "qwen3"),
        ("<|start_header_id|>", {}, "llama3"),
        ("<｜Assistant｜>", {}, "deepseek_v3"),
        ("[INST]", {}, "mistral"),
        ("{{ messages }}", {"model_type": "gpt_oss"}, "gpt_oss"),
        ("{{ messages }}", {"model_type": "llama"}, "generic"),
    ],
)
def test_detection_from_template_and_config(template, config, name):
    assert detect_family(template, config).name == name


def test_an_unknown_model_is_named_in_a_warning(caplog):
    family = family_for("{{ messages }}", {"model_type": "rwkv"}, where="/models/x")
    assert family.name == "generic" and not family.known
    assert "/models/x" in caplog.text and "rwkv" in caplog.text and "model_family" in caplog.text


def test_a_topology_names_the_family_or_is_refused():
    assert family_for("<|im_start|>", override="llama3").name == "llama3"
    with pytest.raises(UnknownFamilyError, match="unknown model_family 'qwen9'; known: "):
        family_named("qwen9")
