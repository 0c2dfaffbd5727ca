"""Real agent CLIs (pi, codex) through the whole stack on a real vLLM (CPU), ``kind: vllm``.

scheduler -> pool -> executor (the CLI, headless) -> proxy -> the session's vLLM
(tests/conftest.py ``vllm_engine``) -> builder -> evaluator. Token mode is the stack's
own proxy; chat mode is a second proxy on the same NATS and Valkey, which a task reaches
through ``agent.settings.proxy_url``. All four sessions run at once on one stack.

The model has random weights, and both CLIs fail a reply cut at its token limit
(pi: "Response was truncated", codex: "Incomplete response returned"), while the random
model's own end token comes after 1.5k-6k tokens. So vLLM serves, for this module, the
tiny model changed to end its turn after one word (``terse_checkpoint``): each CLI gets
a short text reply (no tool call), which ends its session. ``MAX_TOKENS`` bounds a call
all the same (pi's ``maxTokens``; the proxy's default for codex, which asks for none). The prompts are the CLIs' own (pi 2.4k tokens, codex
15.7k): the session's vLLM serves the tiny model's whole 32k context. Every captured
call's logprobs are recomputed by transformers (float32) on the served model.
"""

from __future__ import annotations

import sys
import time

import pytest

from schemas.completion import reconstruct_prompts
from tests.helpers.requires import requires_npm, requires_vllm
from tests.helpers.stack import start_proxy
from tests.helpers.vllm_server import (
    LOGPROB_TOLERANCE,
    hf_model,
    serving,
    teacher_forced_gap,
    terse_checkpoint,
)
from tests.integration.harness_stack import MODEL, Stack, cache_dir, harness_task, preinstall
from tests.unit.engine.tiny import tiny_model_dir

pytestmark = [
    pytest.mark.harness,
    pytest.mark.timeout(1500),  # the first vLLM test of a session waits for its start
    requires_npm,  # the CLIs install with npm
    requires_vllm,
]

MAX_TOKENS = 16
CODEX_PROMPT = 15_700  # tokens (docs/harnesses.md), with room for the reply
# task id -> (harness, proxy mode, Polar protocol)
CASES = {
    "pi-token": ("pi", "token", "openai_chat"),
    "pi-chat": ("pi", "chat", "openai_chat"),
    "codex-token": ("codex", "token", "openai_responses"),
    "codex-chat": ("codex", "chat", "openai_responses"),
}


def task(task_id: str, chat_proxy_url: str) -> dict:
    harness, mode, _ = CASES[task_id]
    settings: dict = {"proxy_url": chat_proxy_url} if mode == "chat" else {}
    if harness == "pi":  # pi asks for 16384 tokens unless its models.json says otherwise
        limits = {"id": MODEL, "maxTokens": MAX_TOKENS, "contextWindow": 32768}
        settings["config"] = {"providers": {"polar": {"models": [limits]}}}
    return harness_task(task_id, harness, settings=settings, agent_timeout=240)


@pytest.fixture(scope="module")
def terse(tmp_path_factory):
    return terse_checkpoint(tmp_path_factory.mktemp("terse") / "model")


@pytest.fixture(scope="module")
async def batch(vllm_engine, terse, tmp_path_factory):
    if vllm_engine.max_model_len < CODEX_PROMPT + MAX_TOKENS:
        pytest.fail(f"the vLLM serves {vllm_engine.max_model_len} tokens: codex needs ~16k")
    await preinstall(cache_dir())
    root = tmp_path_factory.mktemp("harness-vllm")
    backend = {"name": "cpu-vllm", "kind": "vllm", "url": vllm_engine.url}
    proxy = {"model_dir": str(tiny_model_dir()), "default_max_tokens": MAX_TOKENS}
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POLAR_HARNESS_CACHE", str(cache_dir()))  # the node's shared CLI cache
        stack = Stack.up(root, max_run=len(CASES), backend=backend, proxy=proxy)
    chat = None
    try:
        chat = start_proxy(
            stack.topo.nats_url,
            stack.topo.redis_url,
            vllm_engine.url,
            tiny_model_dir(),
            root / "chat-proxy",
            mode="chat",
            backends=[backend],
            default_max_tokens=MAX_TOKENS,
        )
        t1 = time.monotonic()
        async with serving(vllm_engine, terse):
            runs = await stack.run([task(tid, chat.url) for tid in CASES])
        up, ran = t1 - t0, time.monotonic() - t1
        print(f"\nstack up {up:.1f}s; 4 sessions on vLLM {ran:.1f}s", file=sys.stderr)
        yield runs
    finally:
        if chat is not None:
            chat.stop()
        stack.down()


@pytest.fixture(scope="module")
def hf(terse):
    return hf_model(terse)


@pytest.mark.parametrize("task_id", list(CASES))
async def test_cli_session_on_vllm_is_captured_token_exact(batch, hf, task_id):
    run = batch[task_id]
    harness, mode, protocol = CASES[task_id]
    why = f"{task_id}: {run.session.reason} | {run.finished and run.finished.artifacts.stderr_tail[-1500:]}"
    assert run.session.state == "COMPLETED", why
    assert (run.trajectory["harness"], run.trajectory["protocol"]) == (harness, protocol)
    assert run.records, why
    prompts = reconstruct_prompts(run.records)
    gaps = []
    for rec in run.records:
        assert rec.mode == mode and str(rec.protocol) == protocol
        assert rec.finish_reason == "stop", rec.finish_reason  # a reply cut short fails the CLI
        assert prompts[rec.seq] and 0 < len(rec.output_ids) <= MAX_TOKENS
        assert len(rec.output_logprobs) == len(rec.output_ids)
        gaps.append(
            teacher_forced_gap(hf, prompts[rec.seq], list(rec.output_ids), rec.output_logprobs)
        )
    print(
        f"{task_id}: {len(run.records)} call(s), prompts {[len(prompts[r.seq]) for r in run.records]}"
        f" tokens, teacher-forced max |diff| {max(gaps):.2e}",
        file=sys.stderr,
    )
    assert max(gaps) < LOGPROB_TOLERANCE
    # the builder made the session's trajectory from those calls: every sampled token kept
    (trace,) = [t for t in run.trajectory["traces"] if not t.get("side_call")]
    kept = [tok for tok, m in zip(trace["response_ids"], trace["loss_mask"], strict=True) if m]
    assert kept == [tok for r in run.records if r.side_call is None for tok in r.output_ids]
