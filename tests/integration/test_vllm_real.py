"""The vLLM client against a real vLLM (CPU) serving the tiny model: its whole surface.

One server per session (tests/conftest.py ``vllm_engine``, ``--enable-scale-out``);
the probe without scale-out gets a server of its own (module end). The model has random
weights, so where a test needs given text (a hermes tool call, an end token) it asks
vLLM's structured outputs for it (``structured_outputs: {regex}``).
"""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

from proxy.backends import vllm_wire
from proxy.backends.base import (
    BackendError,
    ChatRequest,
    ErrorKind,
    SamplingParams,
    TokenRequest,
)
from proxy.backends.vllm import VLLMBackend
from services.common.tokenization.tokenizer import ChatTokenizer
from services.pool.backpressure import queue_length

# the request the recorder records: one definition of the tool, its forced call and the ask
from tests.fixtures.backends.record_vllm import TOOL as ADD
from tests.fixtures.backends.record_vllm import TOOL_REGEX as TOOL_TEXT
from tests.fixtures.backends.record_vllm import USER
from tests.helpers.prometheus import metric
from tests.helpers.requires import requires_vllm
from tests.helpers.vllm_server import second_checkpoint, start_vllm, tiny_model_dir

# the first test to ask starts vLLM: 2-6 minutes on two loaded cores (pyproject: 300 s)
pytestmark = [requires_vllm, pytest.mark.timeout(900)]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
# float32 CPU kernels (vLLM's vs transformers'): measured max |diff| ~1e-5 on this model
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.load(tiny_model_dir())


@pytest.fixture
async def client(vllm_engine):
    backend = VLLMBackend(vllm_engine.url)
    await backend.probe()
    yield backend
    await backend.aclose()


def forced(regex: str, **over) -> SamplingParams:
    extra = {"structured_outputs": {"regex": regex}}
    return SamplingParams(
        temperature=0.0, max_new_tokens=over.pop("max_new_tokens", 64), extra=extra, **over
    )


async def test_probe_with_scale_out_uses_the_tokens_endpoint(vllm_engine):
    backend = VLLMBackend(vllm_engine.url)
    try:
        caps = await backend.probe()
    finally:
        await backend.aclose()
    assert caps.server == "vllm" and caps.version == "0.32.0"
    assert caps.model == "polar" and caps.context_length == vllm_engine.max_model_len
    assert caps.chat_token_ids is True and caps.token_mode is True
    assert caps.token_endpoint == vllm_wire.GENERATE_PATH
    assert caps.weight_version is None  # vLLM's "default": nobody set one


def engine_ids(url: str, messages: list[dict]) -> list[int]:
    """The prompt ids vLLM renders for ``messages`` (its /tokenize)."""
    body = {"model": "polar", "messages": messages}
    return httpx.post(f"{url}/tokenize", json=body, timeout=30).json()["tokens"]


@pytest.fixture(scope="module")
def ids(vllm_engine) -> list[int]:
    return engine_ids(vllm_engine.url, USER)


async def test_chat_prompt_ids_are_the_engines_rendering(client, tok, ids):
    gen = await client.chat(ChatRequest(session_id="s", messages=USER, sampling=GREEDY))
    assert gen.prompt_ids == ids
    # transformers (so vLLM) loads the tiny model's tokenizer as Qwen2Tokenizer, whose
    # pre-tokenizer splits " 1" into " ", "1"; Polar's tokenizer.json keeps " 1": the same
    # text, other ids. Chat mode records the engine's; token mode sends the proxy's.
    assert tok.decode(ids, False) == tok.render(USER) and ids != tok.render_ids(USER)
    assert len(gen.output_ids) == len(gen.output_logprobs) == 8
    assert gen.finish_reason == "length" and gen.served_model == "polar"
    assert gen.text == tok.decode(gen.output_ids)


async def test_token_generation_matches_chat_and_ends_on_the_stop_token(client, tok, ids):
    chat = await client.chat(ChatRequest(session_id="s", messages=USER, sampling=GREEDY))
    gen = await client.generate(TokenRequest(session_id="s", input_ids=ids, sampling=GREEDY))
    assert gen.output_ids == chat.output_ids
    assert gen.output_logprobs == pytest.approx(chat.output_logprobs, abs=1e-4)
    # an end token: included as the last id, with a logprob; matched_stop names it
    done = await client.generate(
        TokenRequest(session_id="s", input_ids=ids, sampling=forced("Three\\."))
    )
    assert done.finish_reason == "stop"
    assert tok.decode(done.output_ids[:-1]) == "Three."
    assert tok.is_end_of_turn(done.output_ids[-1]) and done.matched_stop == done.output_ids[-1]
    assert len(done.output_logprobs) == len(done.output_ids)


async def test_stop_string_is_the_matched_stop(client, ids):
    sampling = forced("Three\\. Done", stop=["."])
    gen = await client.generate(TokenRequest(session_id="s", input_ids=ids, sampling=sampling))
    assert gen.finish_reason == "stop" and gen.matched_stop == "."


async def test_hermes_tool_call_through_chat(client):
    req = ChatRequest(session_id="s", messages=USER, tools=[ADD], sampling=forced(TOOL_TEXT))
    gen = await client.chat(req)
    assert gen.finish_reason == "tool_calls"
    ((call,),) = [gen.tool_calls]
    assert call.name == "add" and call.arguments.replace(" ", "") == '{"a":1,"b":2}'


async def test_logprobs_match_a_teacher_forced_recomputation(client, tok):
    """Token mode as the proxy sends it (its own rendering), recomputed by transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ids = tok.render_ids(USER)
    sampling = SamplingParams(temperature=1.0, seed=7, max_new_tokens=48)
    gen = await client.generate(TokenRequest(session_id="s", input_ids=ids, sampling=sampling))
    hf = transformers.Qwen2ForCausalLM.from_pretrained(
        str(tiny_model_dir()), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids + gen.output_ids])).logits[0]
    lps = torch.log_softmax(logits, -1)[len(ids) - 1 : -1]
    truth = lps.gather(1, torch.tensor(gen.output_ids)[:, None])[:, 0].tolist()
    worst = max(abs(a - b) for a, b in zip(gen.output_logprobs, truth, strict=True))
    print(f"vLLM vs teacher-forced logprobs: max |diff| {worst:.2e} over {len(truth)} tokens")
    assert worst < LOGPROB_TOLERANCE


async def test_context_length_errors_in_both_modes(client, vllm_engine):
    n = vllm_engine.max_model_len
    long = [{"role": "user", "content": "one " * (n + 1000)}]
    with pytest.raises(BackendError) as chat_err:
        await client.chat(ChatRequest(session_id="s", messages=long, sampling=GREEDY))
    assert chat_err.value.kind is ErrorKind.CONTEXT_LENGTH, chat_err.value.message
    with pytest.raises(BackendError) as token_err:
        await client.generate(
            TokenRequest(session_id="s", input_ids=[5] * (n + 1000), sampling=GREEDY)
        )
    assert token_err.value.kind is ErrorKind.CONTEXT_LENGTH, token_err.value.message
    # prompt + max_tokens past the window: vLLM shortens max_tokens, no error
    near = SamplingParams(temperature=0.0, max_new_tokens=64, extra={"ignore_eos": True})
    gen = await client.generate(
        TokenRequest(session_id="s", input_ids=[5] * (n - 4), sampling=near)
    )
    assert gen.finish_reason == "length" and len(gen.output_ids) == 4


async def generated_tokens(url: str) -> float:
    """Tokens the server has generated so far (its Prometheus counter)."""
    async with httpx.AsyncClient(timeout=10) as http:
        return metric((await http.get(f"{url}/metrics")).text, "vllm:generation_tokens_total")


LONG = 20_000


async def test_pause_abort_returns_partial_output_then_resume(client, vllm_engine, ids):
    # long enough to outlast the wait: the tiny model makes ~1,500 tokens in 0.2 s, ~20,000
    # in a minute (attention grows with the context)
    long = SamplingParams(temperature=1.0, max_new_tokens=LONG, extra={"ignore_eos": True})
    before = await generated_tokens(vllm_engine.url)
    task = asyncio.create_task(
        client.generate(TokenRequest(session_id="s", input_ids=ids, sampling=long))
    )
    # paused once it is generating: after a fixed wait, a loaded machine's engine may not
    # have begun (nothing to return) and an idle one may have finished
    deadline = asyncio.get_running_loop().time() + 120
    while await generated_tokens(vllm_engine.url) < before + 8:
        assert not task.done(), task
        assert asyncio.get_running_loop().time() < deadline, "vLLM generated nothing in 120 s"
        await asyncio.sleep(0.05)
    await client.pause()
    try:
        gen = await asyncio.wait_for(task, 30)
        assert gen.finish_reason == "abort"
        assert 0 < len(gen.output_ids) < LONG and len(gen.output_logprobs) == len(gen.output_ids)
    finally:  # the session's one engine: left paused, every later test's call would hang
        await client.resume()
    again = await client.generate(TokenRequest(session_id="s", input_ids=ids, sampling=GREEDY))
    assert again.finish_reason == "length" and len(again.output_ids) == 8


async def test_reload_from_disk_sets_the_version_and_the_outputs_follow(client, vllm_engine, ids):
    req = TokenRequest(session_id="s", input_ids=ids, sampling=GREEDY)
    before = await client.generate(req)
    assert before.weight_version is None and before.weight_versions == []
    served = vllm_engine.model_dir
    try:
        shutil.copytree(second_checkpoint(), served, dirs_exist_ok=True)
        assert await client.update_weights_from_disk(str(served), "step-1") == "step-1"
        assert await client.weight_version() == "step-1"
        after = await client.generate(req)
        assert after.weight_version == "step-1" and after.weight_versions == ["step-1"]
        assert after.weight_version_starts == [0]
        assert after.output_logprobs != before.output_logprobs
        chat = await client.chat(ChatRequest(session_id="s", messages=USER, sampling=GREEDY))
        assert chat.output_ids == after.output_ids and chat.weight_version == "step-1"
    finally:
        shutil.copytree(tiny_model_dir(), served, dirs_exist_ok=True)
        await client.update_weights_from_disk(str(served), "step-2")
    back = await client.generate(req)
    assert back.output_ids == before.output_ids and back.weight_version == "step-2"
    # leave the session's server as it started: vLLM's own "no version yet"
    await client.http.post_json("/update_weight_version", {"new_version": "default"})
    assert await client.weight_version() is None


def test_metrics_feed_backpressure(vllm_engine):
    text = httpx.get(f"{vllm_engine.url}/metrics", timeout=10).text
    assert "vllm:num_requests_running" in text and "vllm:kv_cache_usage_perc" in text
    assert queue_length(text) == 0.0


@pytest.fixture(scope="module")
def vllm_plain(tmp_path_factory):
    """A second server, without --enable-scale-out (the default a new user gets)."""
    srv = start_vllm(tmp_path_factory.mktemp("vllm-plain"), scale_out=False)
    try:
        yield srv
    finally:
        srv.stop()


async def test_probe_without_scale_out_falls_back_to_completions(vllm_plain, tok):
    backend = VLLMBackend(vllm_plain.url)
    try:
        caps = await backend.probe()
        assert caps.token_mode is True and caps.token_endpoint == vllm_wire.COMPLETIONS_PATH
        ids = tok.render_ids(USER)
        gen = await backend.generate(TokenRequest(session_id="s", input_ids=ids, sampling=GREEDY))
        assert len(gen.output_ids) == len(gen.output_logprobs) == 8
    finally:
        await backend.aclose()


def test_launch_failure_says_what_failed(tmp_path):
    from infra.vllm import VLLMLaunchError, VLLMServer

    with pytest.raises(VLLMLaunchError, match="no config.json"):
        VLLMServer(tmp_path).start()
