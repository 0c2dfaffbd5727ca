"""Embedded model server throughput: batched vs one-at-a-time, at 1, 8 and 32 concurrent requests.

    python tests/bench/bench_embedded.py [--model-dir DIR] [--new-tokens 64] [--requests 64]

Starts two real servers (granian, one worker each) on free ports from the same model
directory: one batching up to 32 sequences per step, one with a batch of 1 (requests are
served strictly one at a time). For each concurrency level the same workload (``requests``
prompts of ~60 tokens, ``new_tokens`` sampled tokens each, EOS ignored) is sent to both,
interleaved, through /generate over HTTP. Prints output tokens/s, requests/s and the
batched / one-at-a-time ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infra.localservers import free_port  # noqa: E402
from services.common.tokenization import ChatTokenizer  # noqa: E402

LEVELS = (1, 8, 32)


def start_server(model_dir: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "services.engine",
        "--model-dir",
        str(model_dir),
        "--port",
        str(port),
        "--max-batch",
        str(max_batch),
        "--max-queue",
        "1024",
        "--prefix-cache-tokens",
        "0",  # every request computes its whole prompt: a fair, cache-free comparison
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server on {url} did not start")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def prompts(tok: ChatTokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = f"Request {i}: list the files in src/, run the tests and summarize any failures briefly."
        out.append(
            tok.render_ids(
                [
                    {"role": "system", "content": "You are a coding agent."},
                    {"role": "user", "content": text},
                ]
            )
        )
    return out


async def run_level(
    url: str, workload: list[list[int]], concurrency: int, new_tokens: int
) -> tuple[float, float, float]:
    """(output tokens/s, requests/s, mean latency s) for the workload at ``concurrency``."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = 0

    async def one(client: httpx.AsyncClient, i: int, ids: list[int]) -> None:
        nonlocal tokens
        body = {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": new_tokens,
                "ignore_eos": True,
                "sampling_seed": i,
            },
        }
        async with gate:
            start = time.perf_counter()
            resp = await client.post(url + "/generate", json=body, timeout=600)
            resp.raise_for_status()
            latencies.append(time.perf_counter() - start)
            tokens += len(resp.json()["output_ids"])

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        await one(client, -1, workload[0])  # warm-up
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
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64, help="requests per level and server")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="polar-bench-") as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from services.engine.modelinit import init_model_dir

            model_dir = init_model_dir(Path(tmp) / "tiny")
        tok = ChatTokenizer.load(model_dir)
        workload = prompts(tok, args.requests)
        batched, batched_url = start_server(model_dir, 32)
        serial, serial_url = start_server(model_dir, 1)
        rows = []
        try:
            for level in LEVELS:
                b = asyncio.run(run_level(batched_url, workload, level, args.new_tokens))
                s = asyncio.run(run_level(serial_url, workload, level, args.new_tokens))
                rows.append((level, b, s))
        finally:
            stop_server(batched)
            stop_server(serial)

    prompt_len = sum(map(len, workload)) // len(workload)
    print(
        f"\nembedded server, {os.cpu_count()} CPUs, {args.requests} requests/level, prompt ~{prompt_len} tokens, {args.new_tokens} new tokens each"
    )
    print(
        f"{'conc':>4} | {'batched tok/s':>13} {'req/s':>7} {'lat s':>6} | {'1-at-a-time tok/s':>17} {'req/s':>7} {'lat s':>6} | {'ratio':>5}"
    )
    for level, (btok, breq, blat), (stok, sreq, slat) in rows:
        print(
            f"{level:>4} | {btok:>13.0f} {breq:>7.2f} {blat:>6.2f} | {stok:>17.0f} {sreq:>7.2f} {slat:>6.2f} | {btok / stok:>5.2f}"
        )


if __name__ == "__main__":
    main()
