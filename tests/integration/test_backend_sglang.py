"""SGLang client against recorded response shapes of several versions, over real HTTP."""

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
from proxy.backends.sglang import SGLangBackend
from schemas.completion import UpstreamMode
from tests.fixtures.backends.backend_replay import (
    ReplayServer,
    fixture_reply,
    load_fixture,
    reply_json,
)

OUT = [9707, 0, 2585, 646, 358, 1492, 498, 3351, 30, 151645]
PROMPT_LEN = 20
CHAT = ChatRequest(
    session_id="s1",
    messages=[{"role": "user", "content": "hi"}],
    sampling=SamplingParams(temperature=0.7, max_new_tokens=64, stop=["\n\n"], seed=3),
)


@pytest.fixture
async def replay():
    server = ReplayServer()
    url = await server.start()
    backends: list[SGLangBackend] = []

    def backend(**kw) -> SGLangBackend:
        b = SGLangBackend(url, **kw)
        backends.append(b)
        return b

    yield server, backend
    for b in backends:
        await b.aclose()
    await server.stop()


def echo_prompt_len(rel: str):
    """The fixture's /generate answer, counting the prompt the probe actually sent."""
    body = load_fixture(rel)["body"]

    def route(rec):
        doc = copy.deepcopy(body)
        doc["meta_info"]["prompt_tokens"] = len(rec.json()["input_ids"])
        return reply_json(doc)

    return route


def serve_info(server: ReplayServer, version: str) -> None:
    if version in ("0.4-legacy", "0.5.3rc2"):
        server.add("GET", "/get_model_info", fixture_reply(f"sglang/{version}/get_model_info.json"))
        server.add(
            "GET", "/get_server_info", fixture_reply(f"sglang/{version}/get_server_info.json")
        )
    else:
        server.add("GET", "/model_info", fixture_reply(f"sglang/{version}/model_info.json"))
        server.add("GET", "/server_info", fixture_reply(f"sglang/{version}/server_info.json"))


# -- the capability probe -------------------------------------------------------------


@pytest.mark.parametrize(("version", "shown"), [("0.4-legacy", "0.4.0"), ("0.5.3rc2", "0.5.3rc2")])
async def test_probe_refuses_chat_mode_when_server_returns_no_token_ids(replay, version, shown):
    server, backend = replay
    serve_info(server, version)
    server.add(
        "POST", "/v1/chat/completions", fixture_reply(f"sglang/{version}/chat_completion.json")
    )
    b = backend(modes=(UpstreamMode.CHAT,))
    with pytest.raises(BackendCapabilityError) as err:
        await b.probe()
    msg = str(err.value)
    assert f"sglang {shown} at {b.base_url}" in msg
    assert "upstream chat mode" in msg and "prompt_token_ids" in msg
    assert "0.5.13" in msg and "Refusing to start" in msg
    sent = server.calls("POST", "/v1/chat/completions")[0].json()
    assert sent["return_prompt_token_ids"] and sent["return_meta_info"] and sent["logprobs"]
    assert sent["max_tokens"] == 1 and sent["stream"] is False


async def test_probe_token_mode_on_legacy_server_falls_back_to_old_endpoint_names(replay):
    server, backend = replay
    serve_info(server, "0.4-legacy")
    server.add("POST", "/generate", echo_prompt_len("sglang/0.4-legacy/generate.json"))
    caps = await backend(modes=(UpstreamMode.TOKEN,)).probe()
    assert (caps.server, caps.version, caps.weight_version) == ("sglang", "0.4.0", None)
    assert caps.token_mode is True and caps.chat_token_ids is None
    assert caps.token_endpoint == "/generate"
    paths = [r.path for r in server.requests if r.method == "GET"]
    assert paths == ["/model_info", "/get_model_info", "/server_info", "/get_server_info"]


async def test_probe_refuses_token_mode_when_generate_lacks_logprobs(replay):
    server, backend = replay
    serve_info(server, "0.5.3rc2")
    body = load_fixture("sglang/0.5.3rc2/generate.json")["body"]
    del body["meta_info"]["output_token_logprobs"]
    server.add("POST", "/generate", reply_json(body))
    with pytest.raises(BackendCapabilityError, match="output_token_logprobs"):
        await backend(modes=(UpstreamMode.TOKEN,)).probe()


@pytest.mark.parametrize(("version", "weights"), [("0.5.13", "default"), ("main-2026", "step-7")])
async def test_probe_accepts_chat_and_token_mode_on_newer_servers(replay, version, weights):
    server, backend = replay
    serve_info(server, version)
    server.add(
        "POST", "/v1/chat/completions", fixture_reply(f"sglang/{version}/chat_completion.json")
    )
    server.add("POST", "/generate", echo_prompt_len(f"sglang/{version}/generate.json"))
    caps = await backend().probe()
    assert caps.chat_token_ids is True and caps.token_mode is True
    assert caps.weight_version == weights
    assert caps.model == "Qwen/Qwen2.5-0.5B-Instruct"


# -- chat mode ------------------------------------------------------------------------


async def test_chat_reads_meta_info_when_choice_logprobs_are_truncated(replay):
    server, backend = replay
    server.add(
        "POST", "/v1/chat/completions", fixture_reply("sglang/0.5.13/chat_truncated_logprobs.json")
    )
    gen = await backend().chat(CHAT)
    assert gen.output_ids == OUT and len(gen.output_logprobs) == len(OUT)
    assert gen.output_logprobs[-1] == -0.0006  # the token logprobs.content dropped
    assert len(gen.prompt_ids) == PROMPT_LEN
    assert (gen.finish_reason, gen.matched_stop, gen.weight_version) == ("stop", 151645, "default")
    sent = server.calls("POST", "/v1/chat/completions")[0].json()
    assert sent["stop"] == ["\n\n"] and sent["seed"] == 3 and sent["temperature"] == 0.7


async def test_chat_with_token_ids_and_meta_info(replay):
    server, backend = replay
    server.add(
        "POST", "/v1/chat/completions", fixture_reply("sglang/main-2026/chat_completion.json")
    )
    gen = await backend().chat(CHAT)
    assert gen.output_ids == OUT and gen.weight_version == "step-7"
    assert gen.text == "Hello! How can I help you today?" and gen.tool_calls == []
    assert gen.worker and gen.upstream_end >= gen.upstream_start > 0


async def test_chat_refuses_truncated_logprobs_without_meta_info(replay):
    server, backend = replay
    server.add(
        "POST",
        "/v1/chat/completions",
        fixture_reply("sglang/main-2026/chat_truncated_no_meta.json"),
    )
    with pytest.raises(BackendError) as err:
        await backend().chat(CHAT)
    assert err.value.kind is ErrorKind.BAD_RESPONSE and "7 of 10" in err.value.message


async def test_chat_tool_call_is_parsed_by_engine(replay):
    server, backend = replay
    server.add("POST", "/v1/chat/completions", fixture_reply("sglang/0.5.13/chat_tool_call.json"))
    gen = await backend().chat(CHAT)
    assert gen.finish_reason == "tool_calls" and len(gen.output_ids) == 21
    [call] = gen.tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    assert call.id.startswith("call_")


async def test_chat_without_ids_is_a_bad_response_not_a_guess(replay):
    server, backend = replay
    server.add(
        "POST", "/v1/chat/completions", fixture_reply("sglang/0.5.3rc2/chat_completion.json")
    )
    with pytest.raises(BackendError) as err:
        await backend().chat(CHAT)
    assert err.value.kind is ErrorKind.BAD_RESPONSE and "prompt_token_ids" in err.value.message


# -- token mode -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "weights"),
    [("0.4-legacy", None), ("0.5.3rc2", "default"), ("0.5.13", "default"), ("main-2026", "step-7")],
)
async def test_generate_across_versions(replay, version, weights):
    server, backend = replay
    server.add("POST", "/generate", fixture_reply(f"sglang/{version}/generate.json"))
    req = TokenRequest(
        session_id="s",
        input_ids=list(range(PROMPT_LEN)),
        sampling=SamplingParams(
            max_new_tokens=32, stop_token_ids=[151645], seed=7, extra={"min_p": 0.1}
        ),
    )
    gen = await backend().generate(req)
    assert gen.output_ids == OUT and gen.prompt_ids == req.input_ids
    assert gen.output_logprobs[0] == -0.0321 and gen.weight_version == weights
    assert (gen.finish_reason, gen.matched_stop) == ("stop", 151645)
    sent = server.calls("POST", "/generate")[0].json()
    assert sent["input_ids"] == req.input_ids and sent["return_logprob"] is True
    assert sent["logprob_start_len"] == -1 and sent["stream"] is False
    assert sent["sampling_params"] == {
        "max_new_tokens": 32,
        "stop_token_ids": [151645],
        "sampling_seed": 7,
        "min_p": 0.1,
    }


@pytest.mark.parametrize(
    ("fixture", "finish", "n"), [("generate_length", "length", 4), ("generate_abort", "abort", 1)]
)
async def test_generate_finish_reasons(replay, fixture, finish, n):
    server, backend = replay
    server.add("POST", "/generate", fixture_reply(f"sglang/0.5.3rc2/{fixture}.json"))
    gen = await backend().generate(TokenRequest(session_id="s", input_ids=list(range(PROMPT_LEN))))
    assert gen.finish_reason == finish and len(gen.output_ids) == n == len(gen.output_logprobs)


async def test_generate_refuses_a_prompt_the_server_counted_differently(replay):
    server, backend = replay
    server.add("POST", "/generate", fixture_reply("sglang/0.5.3rc2/generate.json"))
    with pytest.raises(BackendError, match="20 prompt tokens, 3 were sent"):
        await backend().generate(TokenRequest(session_id="s", input_ids=[1, 2, 3]))


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "fixture", "kind", "status", "retryable"),
    [
        ("/generate", "0.4-legacy/generate_context_error", ErrorKind.CONTEXT_LENGTH, 400, False),
        ("/generate", "0.5.3rc2/generate_context_error", ErrorKind.CONTEXT_LENGTH, 400, False),
        ("/generate", "0.5.3rc2/generate_unavailable", ErrorKind.UNAVAILABLE, 503, True),
        ("/v1/chat/completions", "0.5.13/chat_context_error", ErrorKind.CONTEXT_LENGTH, 400, False),
        ("/v1/chat/completions", "0.5.3rc2/chat_bad_request", ErrorKind.BAD_REQUEST, 400, False),
    ],
)
async def test_error_bodies_become_backend_errors(replay, path, fixture, kind, status, retryable):
    server, backend = replay
    server.add("POST", path, fixture_reply(f"sglang/{fixture}.json"))
    b = backend()
    call = (
        b.generate(TokenRequest(session_id="s", input_ids=[1]))
        if path == "/generate"
        else b.chat(CHAT)
    )
    with pytest.raises(BackendError) as err:
        await call
    exc = err.value
    assert (exc.kind, exc.status, exc.retryable) == (kind, status, retryable)
    assert exc.message and not exc.message.startswith("{") and exc.worker == b.base_url


async def test_unreachable_worker_is_unavailable(replay):
    server, backend = replay
    await server.stop()
    with pytest.raises(BackendError) as err:
        await backend().generate(TokenRequest(session_id="s", input_ids=[1]))
    assert err.value.kind is ErrorKind.UNAVAILABLE and err.value.retryable


# -- weight-update control --------------------------------------------------------------


async def test_control_passthrough(replay):
    server, backend = replay
    v = "sglang/0.5.3rc2"
    server.add("POST", "/pause_generation", fixture_reply(f"{v}/pause_generation.json"))
    server.add("POST", "/continue_generation", fixture_reply(f"{v}/continue_generation.json"))
    server.add("POST", "/flush_cache", fixture_reply(f"{v}/flush_cache.json"))
    server.add(
        "POST", "/update_weights_from_disk", fixture_reply(f"{v}/update_weights_from_disk.json")
    )
    info = load_fixture(f"{v}/get_model_info.json")["body"]
    server.add(
        "GET",
        "/get_model_info",
        [reply_json(info), reply_json({**info, "weight_version": "step-2"})],
    )
    b = backend(pause_mode="retract")
    await b.pause()
    assert await b.weight_version() == "default"
    assert await b.update_weights_from_disk("/ckpt/step-2", "step-2") == "step-2"
    await b.flush_cache()
    await b.resume()
    assert server.calls("POST", "/pause_generation")[0].json() == {"mode": "retract"}
    assert server.calls("POST", "/update_weights_from_disk")[0].json() == {
        "model_path": "/ckpt/step-2",
        "weight_version": "step-2",
    }
    assert (
        len(server.calls("POST", "/flush_cache"))
        == len(server.calls("POST", "/continue_generation"))
        == 1
    )


async def test_failed_weight_update_is_an_error_with_the_engine_message(replay):
    server, backend = replay
    server.add(
        "POST",
        "/update_weights_from_disk",
        fixture_reply("sglang/0.5.3rc2/update_weights_from_disk_error.json"),
    )
    with pytest.raises(BackendError) as err:
        await backend().update_weights_from_disk("/ckpt/step-2")
    assert (
        err.value.kind is ErrorKind.BAD_REQUEST
        and "Failed to get weights iterator" in err.value.message
    )


async def test_weight_version_uses_model_info_on_newer_servers(replay):
    server, backend = replay
    server.add("GET", "/model_info", fixture_reply("sglang/main-2026/model_info.json"))
    server.add(
        "GET", "/weight_version", fixture_reply("sglang/0.5.13/weight_version_deprecated.json")
    )
    b = backend()
    assert await b.weight_version() == "step-7"
    assert await b.weight_version() == "step-7"
    assert [r.path for r in server.requests] == ["/model_info", "/model_info"]


async def test_health(replay):
    server, backend = replay
    server.add("GET", "/health", fixture_reply("sglang/0.4-legacy/health.json"))
    b = backend()
    assert await b.health() is True
    await server.stop()
    assert await b.health() is False


# -- MoE routing (R3) ----------------------------------------------------------------------


async def test_generate_asks_for_routing_and_reads_its_rows(replay):
    """sglang/0.5.13/generate_routed_experts.json (reconstructed: reconstruct_r3.py)."""
    import base64

    import numpy as np

    from proxy.backends.base import RoutingAsk
    from proxy.backends.routed import decoded

    server, backend = replay
    fixture = load_fixture("sglang/0.5.13/generate_routed_experts.json")
    server.add("POST", "/generate", reply_json(fixture["body"]))
    prompt = list(range(20))  # the fixture counts 20 prompt tokens
    ask = RoutingAsk(start=0, top_k=2)
    gen = await backend().generate(TokenRequest(session_id="s", input_ids=prompt, routing=ask))
    assert server.calls("POST", "/generate")[-1].json()["return_routed_experts"] is True
    rows = decoded(gen.routing)
    want = base64.b64decode(fixture["body"]["meta_info"]["routed_experts"])
    assert (rows.start, rows.rows, rows.layers, rows.top_k, rows.dtype) == (0, 29, 3, 2, "int32")
    assert np.array_equal(np.frombuffer(rows.data, "<i4"), np.frombuffer(want, "<i4"))
    plain = await backend().generate(TokenRequest(session_id="s", input_ids=prompt))
    assert plain.routing is None  # not asked: not read
    assert "return_routed_experts" not in server.calls("POST", "/generate")[-1].json()
