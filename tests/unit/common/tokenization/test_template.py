import json

import pytest

from services.common.tokenization import TemplateRenderError, default_template, render_template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "List files."},
    {
        "role": "assistant",
        "content": "Listing.",
        "reasoning_content": "Use ls.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "ls"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "bash", "arguments": {"command": "pwd"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
    {"role": "tool", "tool_call_id": "c2", "content": "/work"},
    {"role": "assistant", "content": "Done: a.txt"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Thanks, "}, {"type": "text", "text": "bye."}],
    },
]


def render(messages, tools=None, **kw):
    return render_template(default_template(), messages, tools, **kw)


def test_plain_user_turn_with_generation_prompt():
    text = render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_no_generation_prompt():
    text = render([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


def test_full_conversation_layout():
    text = render(CONVERSATION, TOOLS)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in text
    assistant = (
        "<|im_start|>assistant\n<think>\nUse ls.\n</think>\n\nListing.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call><|im_end|>\n'
    )
    assert assistant in text
    # Consecutive tool results share one user turn, as in Qwen's template.
    tools_turn = "<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n<tool_response>\n/work\n</tool_response><|im_end|>\n"
    assert tools_turn in text
    assert "<|im_start|>user\nThanks, bye.<|im_end|>\n<|im_start|>assistant\n" in text


def test_tool_call_without_content_has_no_leading_newline():
    msg = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"function": {"name": "f", "arguments": {}}}],
    }
    text = render([{"role": "user", "content": "x"}, msg], add_generation_prompt=False)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
        in text
    )


def test_system_without_tools_and_developer_role():
    text = render([{"role": "developer", "content": "rules"}, {"role": "user", "content": "q"}])
    assert text.startswith("<|im_start|>system\nrules<|im_end|>\n<|im_start|>user\nq<|im_end|>\n")


def test_template_is_append_only():
    """Every prefix that ends at a turn boundary renders to a prefix of the whole
    conversation (consecutive tool results are one turn, so a cut between them is not)."""
    full = render(CONVERSATION, TOOLS, add_generation_prompt=False)
    boundaries = [
        k
        for k in range(1, len(CONVERSATION) + 1)
        if k == len(CONVERSATION)
        or not (CONVERSATION[k - 1]["role"] == CONVERSATION[k]["role"] == "tool")
    ]
    assert len(boundaries) == len(CONVERSATION) - 1
    for k in boundaries:
        assert full.startswith(render(CONVERSATION[:k], TOOLS, add_generation_prompt=False))


def test_unknown_role_and_non_text_parts_raise():
    with pytest.raises(TemplateRenderError, match="Unknown message role"):
        render([{"role": "wizard", "content": "x"}])
    with pytest.raises(TemplateRenderError, match="Only text content parts"):
        render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_hf_conventions_tojson_special_tokens_and_generation_tag():
    source = (
        "{{ bos_token }}{% for m in messages %}{% generation %}{{ m.content | tojson }}"
        "{% endgeneration %}{% endfor %}{{ eos_token }}{% if flag %}!{% endif %}"
    )
    text = render_template(
        source,
        [{"role": "user", "content": 'é"x'}],
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
        flag=True,
    )
    assert text == '<s>"é\\"x"</s>!'


def test_sandbox_blocks_attribute_escape():
    with pytest.raises(TemplateRenderError):
        render_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])


def test_matches_transformers_apply_chat_template(model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    for messages, tools in (
        (CONVERSATION, TOOLS),
        (CONVERSATION[1:2], None),
        (CONVERSATION[:3], TOOLS),
    ):
        for gen in (True, False):
            expected = hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=gen
            )
            assert render(messages, tools, add_generation_prompt=gen) == expected
