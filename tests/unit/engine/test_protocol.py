import json

import msgspec
import pytest

from services.engine import protocol
from services.engine.sampling import SamplingParams
from services.engine.sequence import GenerationResult

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def result_for(tok, text: str, finish=None, **kw) -> GenerationResult:
    ids = tok.encode(text)
    return GenerationResult(
        rid="r1",
        prompt_ids=[1, 2, 3],
        output_ids=ids,
        output_logprobs=[-0.5] * len(ids),
        text=tok.decode(ids),
        finish_reason=finish or {"type": "stop", "matched": ids[-1]},
        weight_version=kw.get("weight_version", "3"),
        weight_versions=[kw.get("weight_version", "3")],
        weight_version_starts=[0],
        cached_tokens=2,
        queue_seconds=0.0,
        e2e_seconds=0.1,
    )


def test_sampling_params_conversion():
    p = protocol.sampling_params(
        {"stop": "END", "top_k": 0, "temperature": None, "max_new_tokens": 9}, 100
    )
    assert p == SamplingParams(stop=["END"], top_k=-1, max_new_tokens=9)
    assert protocol.sampling_params(None, 77).max_new_tokens == 77
    with pytest.raises(protocol.ProtocolError, match="invalid sampling_params"):
        protocol.sampling_params({"temprature": 1}, 10)
    with pytest.raises(protocol.ProtocolError, match="top_p"):
        protocol.sampling_params({"top_p": 2}, 10)
    # Neutral values of features the engine lacks are accepted; real uses are refused.
    assert (
        protocol.sampling_params(
            {"repetition_penalty": 1.0, "n": 1, "regex": None}, 5
        ).max_new_tokens
        == 5
    )
    with pytest.raises(protocol.ProtocolError, match="frequency_penalty=0.5 is not supported"):
        protocol.sampling_params({"frequency_penalty": 0.5}, 10)
    with pytest.raises(protocol.ProtocolError, match="json_schema"):
        protocol.sampling_params({"json_schema": "{}"}, 10)


def test_chat_sampling_params_aliases():
    body = protocol.ChatBody(
        messages=[], max_completion_tokens=5, max_tokens=99, stop="x", seed=10, top_k=3
    )
    p = protocol.chat_sampling_params(body, 256, seed_offset=2)
    assert (p.max_new_tokens, p.stop, p.sampling_seed, p.top_k) == (5, ["x"], 12, 3)
    with pytest.raises(protocol.ProtocolError, match="top_logprobs"):
        protocol.chat_sampling_params(protocol.ChatBody(top_logprobs=2), 256)
    with pytest.raises(protocol.ProtocolError, match="response_format"):
        protocol.chat_sampling_params(
            protocol.ChatBody(response_format={"type": "json_object"}), 256
        )


def test_generate_prompts(tok):
    body = protocol.decode_body(b'{"input_ids": [[1, 2], [3]]}', protocol.GenerateBody)
    assert protocol.generate_prompts(body, tok) == ([[1, 2], [3]], True)
    body = protocol.decode_body(b'{"input_ids": [4, 5]}', protocol.GenerateBody)
    assert protocol.generate_prompts(body, tok) == ([[4, 5]], False)
    body = protocol.decode_body(b'{"text": "hi"}', protocol.GenerateBody)
    assert protocol.generate_prompts(body, tok) == ([tok.encode("hi")], False)
    for bad in (b"{}", b'{"input_ids": [1, "a"]}'):
        with pytest.raises(protocol.ProtocolError):
            protocol.generate_prompts(protocol.decode_body(bad, protocol.GenerateBody), tok)
    with pytest.raises(protocol.ProtocolError, match="invalid request body"):
        protocol.decode_body(b"[1", protocol.GenerateBody)


def test_generate_response_meta_info(tok):
    r = result_for(tok, "hello")
    body = protocol.GenerateBody(input_ids=[1], return_logprob=True, return_text_in_logprobs=True)
    out = protocol.generate_response(r, body, tok)
    assert out["output_ids"] == r.output_ids and out["text"] == "hello"
    meta = out["meta_info"]
    assert (
        meta["weight_version"] == "3" and meta["prompt_tokens"] == 3 and meta["cached_tokens"] == 2
    )
    assert meta["output_token_logprobs"] == [[-0.5, t, tok.token_text(t)] for t in r.output_ids]
    plain = protocol.generate_response(r, protocol.GenerateBody(input_ids=[1]), tok)
    assert "output_token_logprobs" not in plain["meta_info"]


def test_chat_response_with_tool_calls_and_token_extensions(tok):
    text = 'Running.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'
    r = result_for(tok, text)
    body = protocol.ChatBody(
        messages=[{"role": "user", "content": "x"}],
        tools=TOOLS,
        logprobs=True,
        return_prompt_token_ids=True,
        return_token_ids=True,
        return_meta_info=True,
        model="m",
    )
    out = msgspec.json.decode(msgspec.json.encode(protocol.chat_response([r], body, tok)))
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Running."
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "bash", "arguments": json.dumps({"command": "ls"})}
    assert choice["prompt_token_ids"] == [1, 2, 3] and choice["token_ids"] == r.output_ids
    assert choice["meta_info"]["weight_version"] == "3"
    assert [e[1] for e in choice["meta_info"]["output_token_logprobs"]] == r.output_ids
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == r.output_logprobs
    assert out["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": len(r.output_ids),
        "total_tokens": 3 + len(r.output_ids),
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_chat_without_tools_does_not_parse_calls_but_splits_reasoning(tok):
    text = "<think>\nhmm\n</think>\n\n<tool_call>{}</tool_call>"
    r = result_for(tok, text, finish={"type": "length", "length": 5})
    body = protocol.ChatBody(messages=[{"role": "user", "content": "x"}])
    choice = protocol.chat_response([r], body, tok)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] is None
    assert choice["message"]["reasoning_content"] == "hmm"
    assert choice["message"]["content"] == "<tool_call>{}</tool_call>"
    assert "meta_info" not in choice and "token_ids" not in choice and choice["logprobs"] is None


def test_abort_finish_and_error_body(tok):
    r = result_for(tok, "par", finish={"type": "abort", "message": "paused"})
    choice = protocol.chat_response([r], protocol.ChatBody(messages=[]), tok)["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert protocol.error_body("full", 503, "ServiceUnavailable") == {
        "object": "error",
        "message": "full",
        "type": "ServiceUnavailable",
        "param": None,
        "code": 503,
    }
