import json

import pytest

from services.common.tokenization import ChatTokenizer, TokenizerLoadError

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def test_special_and_tag_tokens_are_single_ids(tok):
    for text in SPECIAL + TAGS:
        ids = tok.encode(text)
        assert len(ids) == 1, text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.vocab_size == 4096


def test_roundtrip_of_mixed_text(tok):
    text = 'def f(x):\n    return {"ü": x}  # 日本語 🚀\n$ ls -la /tmp && echo "done"\n'
    assert tok.decode(tok.encode(text)) == text


def test_eos_ids_and_end_of_turn(tok):
    im_end = tok.encode("<|im_end|>")[0]
    eot = tok.encode("<|endoftext|>")[0]
    assert tok.eos_token_ids == sorted([im_end, eot])
    assert tok.is_end_of_turn(im_end) and not tok.is_end_of_turn(tok.encode("a")[0])


def test_skip_special_tokens_keeps_tool_tags(tok):
    ids = tok.encode("<|im_start|>assistant\n<tool_call>x</tool_call><|im_end|>")
    assert tok.decode(ids) == "assistant\n<tool_call>x</tool_call>"


def test_render_ids_equals_encode_of_render(tok):
    messages = [{"role": "user", "content": "hello there"}]
    assert tok.render_ids(messages) == tok.encode(tok.render(messages))


def test_assistant_reply_text_ends_at_end_of_turn(tok):
    text = tok.assistant_reply_text({"content": "Hi!", "reasoning_content": "greet"})
    assert text == "<think>\ngreet\n</think>\n\nHi!<|im_end|>"


def test_parse_reply_from_ids_ignores_end_of_turn(tok):
    body = tok.assistant_reply_text(
        {
            "content": "ok",
            "tool_calls": [{"function": {"name": "bash", "arguments": {"command": "ls"}}}],
        }
    )
    reply = tok.parse_reply(tok.encode(body))
    assert reply.content == "ok"
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("bash", {"command": "ls"})
    ]


def test_missing_tokenizer_is_a_load_error(tmp_path):
    with pytest.raises(TokenizerLoadError, match="no tokenizer.json"):
        ChatTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerLoadError):
        ChatTokenizer.load(tmp_path)


def test_autotokenizer_loads_the_directory_with_the_same_ids(model_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    text = "<|im_start|>user\nRun `pytest -q` on src/<|im_end|>\n<tool_call>\n{}\n</tool_call>"
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf.eos_token == "<|im_end|>"
    assert hf.decode(tok.encode(text), skip_special_tokens=True) == tok.decode(tok.encode(text))
