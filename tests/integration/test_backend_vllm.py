"""vLLM client against recorded response shapes of several versions, over real HTTP."""

from __future__ import annotations

import copy

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

OUT = [9707, 0, 2585, 646, 358, 1492, 498, 3351, 30, 151645]
PROMPT = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645]
CHAT = ChatRequest(session_id="s1", messages=[{"role": "user", "content": "hi"}])


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


async def test_probe_on_main_prefers_the_tokens_endpoint_and_reads_weight_info(replay):
    server, backend = replay
    serve_info(server, "main-2026")
    server.add("GET", "/weight_info", fixture_reply("vllm/main-2026/weight_info.json"))
    server.add("POST", "/v1/chat/completions", fixture_reply("vllm/main-2026/chat_completion.json"))
    server.add(
        "POST", "/inference/v1/generate", fixture_reply("vllm/main-2026/generate_tokens.json")
    )
    b = backend()
    caps = await b.probe()
    assert (caps.token_endpoint, caps.weight_version) == ("/inference/v1/generate", "step-7")
    gen = await b.generate(
        TokenRequest(session_id="s", input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=8))
    )
    assert gen.output_ids == OUT and gen.weight_version == "step-7"
    sent = server.calls("POST", "/inference/v1/generate")[-1].json()
    assert sent["token_ids"] == PROMPT
    assert sent["sampling_params"] == {"max_tokens": 8, "logprobs": 1}
    assert not server.calls("POST", "/v1/completions")


# -- chat mode ------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.10.2", "main-2026"])
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


async def test_chat_tool_call(replay):
    server, backend = replay
    server.add("POST", "/v1/chat/completions", fixture_reply("vllm/main-2026/chat_tool_call.json"))
    gen = await backend().chat(CHAT)
    [call] = gen.tool_calls
    assert (gen.finish_reason, call.name, call.arguments) == (
        "tool_calls",
        "get_weather",
        '{"city": "Paris"}',
    )
    assert gen.text == ""


async def test_chat_truncated_logprobs_are_refused(replay):
    server, backend = replay
    server.add(
        "POST", "/v1/chat/completions", fixture_reply("vllm/main-2026/chat_truncated_logprobs.json")
    )
    with pytest.raises(BackendError) as err:
        await backend().chat(CHAT)
    assert err.value.kind is ErrorKind.BAD_RESPONSE and "9 of 10" in err.value.message


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.8.5", "0.10.2", "main-2026"])
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


# -- weight-update control --------------------------------------------------------------


async def test_control_on_main(replay):
    server, backend = replay
    server.add("POST", "/pause", fixture_reply("vllm/main-2026/pause.json"))
    server.add("POST", "/resume", fixture_reply("vllm/main-2026/resume.json"))
    server.add("POST", "/reset_prefix_cache", reply_json(None))
    server.add("POST", "/reload", reply_json({"ok": True}))
    server.add(
        "POST", "/update_weight_version", fixture_reply("vllm/main-2026/update_weight_version.json")
    )
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
    assert server.calls("POST", "/update_weight_version")[0].json() == {"new_version": "step-8"}
    assert await b.weight_version() == "step-8"  # no /weight_info here: the one it set


async def test_control_unsupported_on_servers_without_rl_endpoints(replay):
    server, backend = replay
    b = backend()
    with pytest.raises(BackendError) as err:
        await b.pause()
    assert err.value.kind is ErrorKind.UNSUPPORTED and "VLLM_SERVER_DEV_MODE" in err.value.message
    with pytest.raises(BackendError) as err:
        await b.update_weights_from_disk("/ckpt")
    assert err.value.kind is ErrorKind.UNSUPPORTED and not server.requests[1:]


async def test_pause_failure_body_is_reported(replay):
    server, backend = replay
    server.add("POST", "/pause", fixture_reply("vllm/main-2026/pause_error.json"))
    with pytest.raises(BackendError) as err:
        await backend().pause()
    assert err.value.kind is ErrorKind.SERVER_ERROR
    assert err.value.message == "Failed to pause generation: engine is sleeping"
