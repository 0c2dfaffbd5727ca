import json

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.tokenization import parse_reply, parse_tool_call, split_reasoning

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "line": {"type": "integer"},
                    "scale": {"type": "number"},
                    "dry_run": {"type": "boolean"},
                    "tags": {"type": "array"},
                    "opts": {"type": "object"},
                },
            },
        },
    }
]


def test_hermes_json_single_call_with_text_before():
    text = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
    reply = parse_reply(text)
    assert reply.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("bash", {"command": "ls -la"})
    ]
    assert reply.errors == [] and reply.reasoning is None


def test_multiple_calls_and_string_arguments():
    text = (
        '<tool_call>\n{"name": "a", "arguments": "{\\"x\\": 1}"}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    )
    reply = parse_reply(text)
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]
    assert reply.content == ""


def test_non_ascii_arguments_are_kept_verbatim():
    call = parse_tool_call('{"name": "say", "arguments": {"text": "héllo 日本"}}')
    assert call.arguments == '{"text": "héllo 日本"}'


def test_malformed_json_stays_in_content_with_an_error():
    text = 'ok <tool_call>\n{"name": "bash", "arguments": {"command": }\n</tool_call> end'
    reply = parse_reply(text)
    assert reply.tool_calls == []
    assert reply.content == text
    assert len(reply.errors) == 1 and "not valid JSON" in reply.errors[0]


def test_missing_name_and_non_object_arguments_are_errors():
    reply = parse_reply(
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": [1]}</tool_call>'
    )
    assert reply.tool_calls == []
    assert len(reply.errors) == 2


def test_one_good_one_bad_call():
    text = '<tool_call>{"name": "good", "arguments": {}}</tool_call>\n<tool_call>{oops}</tool_call>'
    reply = parse_reply(text)
    assert [c.name for c in reply.tool_calls] == ["good"]
    assert reply.content == "<tool_call>{oops}</tool_call>"


def test_unterminated_call_is_an_error():
    text = 'Sure.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}'
    reply = parse_reply(text)
    assert reply.tool_calls == []
    assert reply.content == text
    assert "unterminated" in reply.errors[0]


def test_qwen3_coder_xml_typed_by_schema():
    text = (
        "<tool_call>\n<function=edit>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
        "<parameter=line>\n42\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n"
        '<parameter=dry_run>\ntrue\n</parameter>\n<parameter=tags>\n["x", "y"]\n</parameter>\n'
        '<parameter=opts>\n{"a": 1}\n</parameter>\n</function>\n</tool_call>'
    )
    reply = parse_reply(text, TOOLS)
    assert reply.errors == []
    (call,) = reply.tool_calls
    assert call.name == "edit"
    assert json.loads(call.arguments) == {
        "path": "src/a.py",
        "line": 42,
        "scale": 1.5,
        "dry_run": True,
        "tags": ["x", "y"],
        "opts": {"a": 1},
    }


def test_xml_without_schema_keeps_strings_and_multiline_values():
    text = "<tool_call>\n<function=write>\n<parameter=body>\nline 1\nline 2\n</parameter>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>"
    (call,) = parse_reply(text).tool_calls
    assert json.loads(call.arguments) == {"body": "line 1\nline 2", "n": "7"}


def test_xml_value_that_does_not_match_its_type_is_kept_as_text():
    text = "<tool_call>\n<function=edit>\n<parameter=line>\nforty\n</parameter>\n</function>\n</tool_call>"
    (call,) = parse_reply(text, TOOLS).tool_calls
    assert json.loads(call.arguments) == {"line": "forty"}


def test_xml_without_function_is_an_error():
    reply = parse_reply("<tool_call>\n<function=>\n</function>\n</tool_call>")
    assert reply.tool_calls == [] and reply.errors


def test_reasoning_split_variants():
    assert split_reasoning("<think>\nplan\n</think>\n\nanswer") == ("plan", "answer")
    assert split_reasoning("plan only closed</think>answer") == ("plan only closed", "answer")
    assert split_reasoning("<think>\ncut off by length") == ("cut off by length", "")
    assert split_reasoning("no reasoning here") == (None, "no reasoning here")


def test_reasoning_then_tool_call():
    text = '<think>\nneed ls\n</think>\n\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    reply = parse_reply(text)
    assert reply.reasoning == "need ls"
    assert reply.content == ""
    assert reply.tool_calls[0].name == "bash"


json_scalars = st.one_of(
    st.integers(-(10**6), 10**6), st.text(max_size=20), st.booleans(), st.none()
)
arguments = st.dictionaries(st.text(min_size=1, max_size=10), json_scalars, max_size=4)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True)


@settings(max_examples=60, deadline=None)
@given(
    names=st.lists(names, min_size=1, max_size=3),
    args=st.lists(arguments, min_size=3, max_size=3),
    text=st.text(max_size=30),
)
def test_rendered_calls_parse_back(tok, names, args, text):
    """What the chat template writes for a tool-calling turn parses back to the same calls."""
    calls = [
        {"type": "function", "function": {"name": n, "arguments": a}}
        for n, a in zip(names, args, strict=False)
    ]
    body = tok.assistant_reply_text({"content": text, "tool_calls": calls})
    reply = tok.parse_reply(tok.encode(body))
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        (n, a) for n, a in zip(names, args, strict=False)
    ]
