"""Response parsing edge cases the recorded fixtures do not all cover (pure)."""

from __future__ import annotations

import pytest

from proxy.backends import sglang_wire, vllm_wire, wire
from proxy.backends.base import BackendError, ChatRequest, SamplingParams, TokenRequest
from proxy.backends.control import agreed_version
from proxy.backends.wire import normalize_finish, parse_tool_calls, token_id_from_text

REQ = TokenRequest(session_id="s", input_ids=[5, 6])


def test_sglang_output_logprobs_in_all_three_shapes():
    tuples = {"output_token_logprobs": [[-0.5, 11, None], [-0.25, 12, "x"]]}
    dicts = {
        "output_token_logprobs": [{"logprob": -0.5, "token_id": 11}, {"logprob": -0.25, "id": 12}]
    }
    split = {"output_token_logprobs_val": [-0.5, -0.25], "output_token_logprobs_idx": [11, 12]}
    for meta in (tuples, dicts, split):
        assert sglang_wire.output_pairs(meta) == ([11, 12], [-0.5, -0.25])
    assert sglang_wire.output_pairs({}) is None


def test_token_lists_are_read_alike_on_the_fast_path_and_off_it():
    """msgspec checks the usual lists in C; what it refuses goes through the loop that
    was there before: a number sent as a string or a bool still reads as before, and a
    broken entry is named as before."""
    assert wire.int_ids([1, 2, 151645], "ids") == [1, 2, 151645]
    assert wire.int_ids(["7", True, 3.0], "ids") == [7, 1, 3]  # the old loop's reading
    assert wire.float_logprobs([0, -1, -0.5], "lps") == [0.0, -1.0, -0.5]
    assert all(type(v) is float for v in wire.float_logprobs([0, -1], "lps"))
    assert wire.float_logprobs(["-0.5"], "lps") == [-0.5]
    with pytest.raises(BackendError, match="lps: logprob 2 is null"):
        wire.float_logprobs([-0.1, -0.2, None], "lps")
    with pytest.raises(ValueError):
        wire.int_ids([1, "x"], "ids")
    # each SGLang shape: the triples' fast path and the mixed shapes' loop agree
    triples = [[-0.5, 11, None], [-0.25, 12, "x"], [0, 13, None]]
    mixed = [*triples[:2], {"logprob": 0, "token_id": 13}]
    fast = sglang_wire.output_pairs({"output_token_logprobs": triples})
    assert fast == sglang_wire.output_pairs({"output_token_logprobs": mixed})
    assert fast == ([11, 12, 13], [-0.5, -0.25, 0.0])
    assert sglang_wire.output_pairs({"output_token_logprobs": []}) == ([], [])
    chat = {"choices": [{"prompt_token_ids": ["5", 6], "meta_info": SPANNED, "message": {}}]}
    assert sglang_wire.parse_chat(chat).prompt_ids == [5, 6]


def test_sglang_null_output_logprob_is_refused():
    with pytest.raises(BackendError, match="logprob 1 is null"):
        sglang_wire.output_pairs({"output_token_logprobs": [[-0.5, 11, None], [None, 12, None]]})


def test_sglang_output_ids_must_agree_with_logprob_ids():
    body = {
        "output_ids": [11, 99],
        "meta_info": {"output_token_logprobs": [[-0.5, 11, None], [-0.2, 12, None]]},
    }
    with pytest.raises(BackendError, match="output_ids disagrees"):
        sglang_wire.parse_generate(body, REQ)


SPANNED = {  # the embedded engine's meta_info for a request paused across a weight swap
    "weight_version": "2",
    "weight_versions": ["1", "2"],
    "weight_version_starts": [0, 2],
    "output_token_logprobs": [[-0.5, 11, None], [-0.2, 12, None], [-0.1, 13, None]],
}


def test_sglang_generation_says_which_weights_produced_which_tokens():
    gen = sglang_wire.parse_generate({"meta_info": SPANNED}, REQ)
    assert (gen.weight_version, gen.weight_versions, gen.weight_version_starts) == (
        "2",
        ["1", "2"],
        [0, 2],
    )
    chat = {"choices": [{"prompt_token_ids": [5, 6], "meta_info": SPANNED, "message": {}}]}
    gen = sglang_wire.parse_chat(chat)
    assert (gen.weight_versions, gen.weight_version_starts) == (["1", "2"], [0, 2])
    plain = {"meta_info": {"output_token_logprobs": [[-0.5, 11, None]], "weight_version": 3}}
    gen = sglang_wire.parse_generate(plain, REQ)  # a server that does not say: none claimed
    assert (gen.weight_version, gen.weight_versions, gen.weight_version_starts) == ("3", [], [])


@pytest.mark.parametrize(
    ("versions", "starts"),
    [(["1", "2"], [0]), (["1", "2"], [0, 4]), (["1", "2"], [1, 2]), (["1", "2"], [2, 0])],
)
def test_sglang_weight_spans_that_do_not_split_the_output_are_refused(versions, starts):
    meta = {**SPANNED, "weight_versions": versions, "weight_version_starts": starts}
    with pytest.raises(BackendError, match="weight_version"):
        sglang_wire.parse_generate({"meta_info": meta}, REQ)


def test_sglang_generate_body_omits_unset_sampling():
    body = sglang_wire.build_generate_body(REQ)
    assert body["sampling_params"] == {} and body["return_logprob"] is True


def test_chat_bodies_carry_tools_and_extras():
    req = ChatRequest(
        session_id="s",
        messages=[{"role": "user", "content": "x"}],
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice="auto",
        sampling=SamplingParams(top_k=20, extra={"repetition_penalty": 1.1}),
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    s = sglang_wire.build_chat_body(req, "m")
    v = vllm_wire.build_chat_body(req, "m")
    for body in (s, v):
        assert body["tools"] == req.tools and body["tool_choice"] == "auto" and body["top_k"] == 20
        assert body["repetition_penalty"] == 1.1 and body["chat_template_kwargs"] == {
            "enable_thinking": False
        }
    assert s["return_meta_info"] and "return_meta_info" not in v and v["return_token_ids"]


def test_vllm_chat_ids_from_token_id_strings_when_token_ids_absent():
    body = {
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "message": {"content": "a"},
                "logprobs": {"content": [{"token": "token_id:7", "logprob": -0.1}]},
                "finish_reason": "length",
            }
        ],
    }
    gen = vllm_wire.parse_chat(body)
    assert (gen.output_ids, gen.finish_reason) == ([7], "length")


def test_vllm_completions_echoed_prompt_must_match():
    body = {
        "choices": [
            {
                "text": "a",
                "token_ids": [7],
                "prompt_token_ids": [5, 9],
                "logprobs": {"token_logprobs": [-0.1], "tokens": ["token_id:7"]},
            }
        ]
    }
    with pytest.raises(BackendError, match="differ from the ids sent"):
        vllm_wire.parse_completions(body, REQ)


def test_finish_reasons_and_tool_call_arguments():
    assert normalize_finish({"type": "length", "length": 4}) == "length"
    assert normalize_finish("function_call") == "tool_calls"
    assert normalize_finish(None) == "abort"
    assert normalize_finish("content_filter") == "stop"
    [call] = parse_tool_calls({"tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]})
    assert (call.id, call.arguments) == ("call_0", '{"a":1}')
    assert token_id_from_text("token_id:12") == 12 and token_id_from_text("hello") is None


def test_weight_versions_must_agree():
    assert agreed_version(["3", "3"]) == "3"
    assert agreed_version([None, None]) is None
    with pytest.raises(BackendError, match="disagree"):
        agreed_version(["3", "4"])
    with pytest.raises(BackendError, match="disagree"):
        agreed_version(["3", None])
