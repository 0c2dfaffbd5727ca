"""The proxy in token mode in front of a real vLLM (CPU) serving a real vocabulary:
Qwen3.5's tokenizer and official chat template on a tiny random Qwen3
(tests/helpers/model_families.py, ``family_model_dir("qwen3_5", weights=True)``).

For a first call with a system prompt, a user message and two tools, thinking on (the
template's default) and off (``chat_template_kwargs``):

* the prompt the proxy rendered (the captured record's ids) is the one vLLM renders itself
  for the same request (its chat endpoint's ``prompt_token_ids`` and its ``/tokenize``);
* the captured logprobs are the ones transformers computes reading prompt + output;
* a second call that echoes the answer back and adds a user message extends the first.

The model has random weights: its answers are random text, cut at ``max_tokens``.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from schemas.completion import CompletionRecord, common_prefix_length, reconstruct_prompts
from services.common.registry import Registry
from tests.helpers.model_families import family_model_dir
from tests.helpers.requires import requires_vllm
from tests.helpers.stack import running_session, start_proxy
from tests.helpers.vllm_server import (
    LOGPROB_TOLERANCE,
    hf_model,
    running_vllm,
    start_vllm,
    teacher_forced_gap,
)
from tests.integration.proxy_agents import SCHEMA, SYSTEM, TASK, captured, session_url

# vLLM's start: 2-6 minutes on two loaded cores (pyproject: 300 s)
pytestmark = [requires_vllm, pytest.mark.timeout(900)]

FAMILY = "qwen3_5"
CONTEXT = 4096  # a few calls of a few hundred tokens
MAX_TOKENS = 16
TOOLS = [
    {
        "type": "function",
        "function": {"name": "exec_command", "description": "run a command", "parameters": SCHEMA},
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "read a file of the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["path"],
            },
        },
    },
]
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
FOLLOW_UP = {"role": "user", "content": "Thanks. Now run the tests again, naïvely ✓."}
THINKING = {"thinking": {}, "no-thinking": {"chat_template_kwargs": {"enable_thinking": False}}}


@pytest.fixture(scope="module")
def model_dir():
    return family_model_dir(FAMILY, weights=True)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    """vLLM serving the fixture's directory; a developer's server on that same directory
    (``POLAR_TEST_VLLM_URL`` / ``POLAR_TEST_VLLM_MODEL_DIR``) if one is named."""
    if (given := running_vllm()) and given.model_dir == model_dir:
        yield given
        return
    root = tmp_path_factory.mktemp(f"vllm-{FAMILY}")
    srv = start_vllm(root, model_dir=model_dir, max_model_len=CONTEXT)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def proxy(engine, model_dir, nats_url, redis_url, tmp_path_factory):
    backends = [{"name": "cpu-vllm", "kind": "vllm", "url": engine.url}]
    log_dir = tmp_path_factory.mktemp("plogs")
    p = start_proxy(
        nats_url, redis_url, engine.url, model_dir, log_dir, mode="token", backends=backends
    )
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def hf(model_dir):
    return hf_model(model_dir)


def vllm_rendering(url: str, extra: dict) -> list[int]:
    """The prompt ids vLLM renders for the first call: its chat endpoint's (what it would
    sample from), checked against its ``/tokenize``."""
    body = {"model": "polar", "messages": FIRST, "tools": TOOLS, **extra}
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json=body | {"max_tokens": 1, "return_token_ids": True},
        timeout=120,
    )
    chat.raise_for_status()
    ids = chat.json()["prompt_token_ids"]
    tokenized = httpx.post(f"{url}/tokenize", json=body, timeout=120)
    tokenized.raise_for_status()
    assert tokenized.json()["tokens"] == ids, "vLLM's /tokenize and chat endpoint disagree"
    return ids


def check_logprobs(hf, prompt: list[int], rec: CompletionRecord) -> float:
    assert len(rec.output_ids) == len(rec.output_logprobs) > 0
    gap = teacher_forced_gap(hf, prompt, list(rec.output_ids), list(rec.output_logprobs))
    assert gap < LOGPROB_TOLERANCE, f"seq {rec.seq}: teacher-forced max |diff| {gap:.2e}"
    return gap


def first_difference(ours: list[int], theirs: list[int], model_dir) -> str:
    """Where two renderings part, decoded around it (for the failure message)."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    i = common_prefix_length(ours, theirs)

    def around(ids: list[int]) -> str:
        return repr(tok.decode(ids[max(0, i - 8) : i + 8], skip_special_tokens=False))

    return (
        f"lengths {len(ours)} vs {len(theirs)}, first difference at {i}: "
        f"proxy {ours[i : i + 8]} {around(ours)} | vLLM {theirs[i : i + 8]} {around(theirs)}"
    )


@pytest.mark.parametrize("thinking", list(THINKING))
async def test_prompt_and_logprobs_match_vllm_and_a_continuation_extends(
    proxy, engine, model_dir, hf, bus, redis_client, thinking
):
    extra = THINKING[thinking]
    (session,) = await running_session(Registry(redis_client), f"real-vocab-{thinking}")
    client = openai.AsyncOpenAI(
        base_url=session_url(proxy.url, session.token) + "/v1", api_key="unused", max_retries=0
    )
    kw = {"model": "m", "tools": TOOLS, "max_tokens": MAX_TOKENS, "extra_body": extra or None}
    done = await client.chat.completions.create(messages=FIRST, **kw)
    answer = done.choices[0].message.model_dump(exclude_none=True)
    messages = [*FIRST, answer, FOLLOW_UP]
    await client.chat.completions.create(messages=messages, **kw)

    first, second = await captured(bus, session.session_id, expect=2)
    prompts = reconstruct_prompts([first, second])
    expected = vllm_rendering(engine.url, extra)
    assert prompts[first.seq] == expected, first_difference(prompts[first.seq], expected, model_dir)
    assert second.extends_previous is True, second.drift_reason
    gaps = [check_logprobs(hf, prompts[rec.seq], rec) for rec in (first, second)]
    print(
        f"{thinking}: call 1 prompt {len(expected)} ids equal vLLM's; call 2 prompt "
        f"{len(prompts[second.seq])} ids extends it; teacher-forced max |diff| {max(gaps):.2e}"
    )
