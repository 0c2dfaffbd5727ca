"""The proxy's start-up probe against a real (small) HTTP server: an engine's refusal is
reported at once, only a not-ready engine is waited for, and the token-mode probe sends
ids of the served model's own tokenizer."""

import time

import pytest

from proxy.backends.base import BackendCapabilityError, BackendError, ErrorKind
from proxy.backends.factory import make_pool
from proxy.backends.probe import PROBE_MESSAGES
from proxy.main import LazyTokenizer, probe_until_up
from schemas import UpstreamMode
from services.common.tokenization import ChatTokenizer
from tests.helpers.http_sink import JsonServer

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

VOCAB_REFUSAL = {"error": {"message": "token id 0 is outside the vocabulary"}}


def generated(req: dict) -> tuple[int, dict]:
    """An SGLang /generate answer: one output token, with its logprob."""
    n = len(req["input_ids"])
    meta = {
        "id": "probe",
        "finish_reason": {"type": "length", "length": 1},
        "prompt_tokens": n,
        "completion_tokens": 1,
        "output_token_logprobs": [[-0.5, 7, None]],
    }
    return 200, {"text": "O", "output_ids": [7], "meta_info": meta}


def sglang_routes(generate) -> dict:
    return {
        ("GET", "/model_info"): lambda _: (200, {"model_path": "tiny"}),
        ("GET", "/server_info"): lambda _: (200, {"version": "0.5.9"}),
        ("GET", "/health"): lambda _: (200, {}),
        ("POST", "/generate"): generate,
    }


def token_pool(url: str):
    return make_pool("sglang", [url], modes=(UpstreamMode.TOKEN,))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from services.engine.modelinit import init_model_dir

    return init_model_dir(tmp_path_factory.mktemp("probe") / "tiny")


async def test_a_refusal_is_reported_at_once_not_retried():
    async with JsonServer(sglang_routes(lambda _: (500, VOCAB_REFUSAL))) as engine:
        url = engine.url
        pool = token_pool(url)
        t0 = time.monotonic()
        with pytest.raises(BackendCapabilityError) as err:
            await probe_until_up(pool, timeout=20)
        elapsed = time.monotonic() - t0
        await pool.aclose()
    assert elapsed < 5, elapsed
    assert "token id 0 is outside the vocabulary" in err.value.message
    assert "HTTP 500" in err.value.message and url in err.value.message
    assert [r[1] for r in engine.requests].count("/generate") == 1


async def test_a_4xx_refusal_is_final_too():
    bad = (400, {"object": "error", "message": "input_ids must not be empty", "code": 400})
    async with JsonServer(sglang_routes(lambda _: bad)) as engine:
        pool = token_pool(engine.url)
        with pytest.raises(BackendCapabilityError, match="HTTP 400.*must not be empty"):
            await probe_until_up(pool, timeout=20)
        await pool.aclose()


async def test_a_starting_engine_is_waited_for():
    calls = {"n": 0}

    def loading(req):
        calls["n"] += 1
        return (503, {"error": "model is loading"}) if calls["n"] <= 2 else generated(req)

    async with JsonServer(sglang_routes(loading)) as engine:
        pool = token_pool(engine.url)
        await probe_until_up(pool, timeout=20)
        await pool.aclose()
    assert calls["n"] == 3


async def test_no_engine_at_all_is_waited_for_until_the_timeout():
    from infra.localservers import free_port

    pool = token_pool(f"http://127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    with pytest.raises(BackendError) as err:
        await probe_until_up(pool, timeout=1.5)
    await pool.aclose()
    assert time.monotonic() - t0 >= 1.5
    assert err.value.kind is ErrorKind.UNAVAILABLE
    assert not isinstance(err.value, BackendCapabilityError)


async def test_the_token_probe_sends_ids_the_tokenizer_has(model_dir):
    """An engine that refuses id 0 (as the issue's did) passes the probe: it is sent the
    probe message through the served model's template, not [0]."""

    def strict(req):
        return (500, VOCAB_REFUSAL) if 0 in req["input_ids"] else generated(req)

    tok = ChatTokenizer.load(model_dir)
    async with JsonServer(sglang_routes(strict)) as engine:
        pool = token_pool(engine.url)
        lazy = LazyTokenizer(str(model_dir))
        await probe_until_up(pool, timeout=20, input_ids=lazy.probe_ids)
        await pool.aclose()
    (sent,) = [r[2]["input_ids"] for r in engine.requests if r[1] == "/generate"]
    assert sent == tok.render_ids(PROBE_MESSAGES)
    assert all(0 < i < tok.vocab_size for i in sent)
