"""Backend client HTTP cost: httpx vs aiohttp vs the full SGLang client (plain script).

    python tests/bench/bench_backend_http.py [--n 2000]

A replay server in a separate process answers /generate with a 200-token body; the
client side runs sequential calls (latency) and 64 concurrent calls (throughput). The
"client" row is ``SGLangBackend.generate`` end to end, parsing included.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import aiohttp
import httpx
import orjson

from proxy.backends.base import TokenRequest
from proxy.backends.sglang import SGLangBackend

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "backends"
PROMPT = list(range(2000))
SERVER = textwrap.dedent(
    f"""
    import asyncio, sys
    sys.path.insert(0, {str(FIXTURES)!r})
    from backend_replay import ReplayServer, reply_json
    out = list(range(200))
    body = {{"text": "x" * 800, "output_ids": out, "meta_info": {{"prompt_tokens": {len(PROMPT)},
            "weight_version": "3", "finish_reason": {{"type": "length", "length": 200}},
            "output_token_logprobs": [[-0.1, t, None] for t in out]}}}}
    async def main():
        s = ReplayServer()
        s.add("POST", "/generate", reply_json(body))
        s.requests = type("Sink", (list,), {{"append": lambda self, x: None}})()
        print(await s.start(), flush=True)
        await asyncio.Event().wait()
    asyncio.run(main())
    """
)
REQ = orjson.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200}})
HEADERS = {"content-type": "application/json"}


async def drive(one, n: int, concurrency: int) -> tuple[float, float | None]:
    for _ in range(50):
        await one()
    latencies: list[float] = []
    start = time.perf_counter()
    if concurrency == 1:
        for _ in range(n):
            t = time.perf_counter()
            await one()
            latencies.append(time.perf_counter() - t)
    else:
        gate = asyncio.Semaphore(concurrency)

        async def gated():
            async with gate:
                await one()

        await asyncio.gather(*(gated() for _ in range(n)))
    rate = n / (time.perf_counter() - start)
    return rate, statistics.median(latencies) * 1e6 if latencies else None


async def bench_httpx(url: str, n: int, conc: int):
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:

        async def one():
            orjson.loads((await client.post("/generate", content=REQ, headers=HEADERS)).content)

        return await drive(one, n, conc)


async def bench_aiohttp(url: str, n: int, conc: int):
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as client:

        async def one():
            async with client.post(url + "/generate", data=REQ, headers=HEADERS) as resp:
                orjson.loads(await resp.read())

        return await drive(one, n, conc)


async def bench_client(url: str, n: int, conc: int):
    backend = SGLangBackend(url)
    req = TokenRequest(session_id="bench", input_ids=PROMPT)
    try:
        return await drive(lambda: backend.generate(req), n, conc)
    finally:
        await backend.aclose()


async def run_all(url: str, n: int) -> None:
    benches = (("httpx", bench_httpx), ("aiohttp", bench_aiohttp), ("client", bench_client))
    for name, bench in benches:
        seq, p50 = await bench(url, n, 1)
        conc, _ = await bench(url, n, 64)
        print(
            f"{name:8s} sequential {seq:6.0f} req/s p50 {p50:5.0f} us | 64 at once {conc:6.0f} req/s"
        )


def main(n: int) -> None:
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        asyncio.run(run_all(proc.stdout.readline().strip(), n))
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2000)
    main(parser.parse_args().n)
