"""Huge prompts against a real proxy process (issue 33, item 5): its memory, and other
sessions' small calls meanwhile.

    python tests/bench/bench_huge_prompt.py [--prompts 5] [--mb 10] [--rounds 1] [--settle 30]
        [--config '{"context_tokens": 0}']

NATS, Valkey, the embedded engine (the tiny model: a 32,768-token context) and the proxy
in token mode, as ``tests/integration/test_proxy_huge_prompt.py`` starts them. Small
calls (4 tokens) of one session are timed alone, then while another session sends
``--prompts`` distinct prompts of ``--mb`` MiB each, one after another (``--rounds``
times). The proxy's RSS (``/proc/<pid>/status``) is read before, right after, and
``--settle`` seconds later. ``--config`` adds proxy settings: ``{"context_tokens": 0}``
turns the byte bound off, so the prompts are templated and tokenized in full (off the
event loop) as before it, and only their memory's give-back is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from infra import localservers  # noqa: E402
from tests.helpers.stack import EmbeddedServer, new_session, start_proxy  # noqa: E402
from tests.unit.engine.tiny import tiny_model_dir  # noqa: E402

SMALL = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def huge_body(i: int, mb: float) -> bytes:
    words = int(mb * 2**20) // 7  # "w01234 "
    text = f"prompt {i} " + " ".join(f"w{(i * 7919 + k) % 100_000:05d}" for k in range(words))
    return orjson.dumps({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "start"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": text},
    ]})  # fmt: skip


async def small_call(client: httpx.AsyncClient, token: str) -> float:
    t0 = time.perf_counter()
    r = await client.post(f"/s/{token}/v1/chat/completions", json=SMALL)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def send_all(url: str, token: str, bodies: list[bytes]) -> list[tuple[int, float, str]]:
    answers = []
    with httpx.Client(base_url=url, timeout=600) as client:
        for body in bodies:
            t = time.perf_counter()
            reply = client.post(
                f"/s/{token}/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
            )
            answers.append((reply.status_code, time.perf_counter() - t, reply.text[:160]))
    return answers


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def run(url: str, pid: int, redis_url: str, args) -> None:
    r = aioredis.from_url(redis_url)
    small, big = await new_session(r, "bench-small"), await new_session(r, "bench-big")
    bodies = [huge_body(i, args.mb) for i in range(args.prompts)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for _ in range(5):
            await small_call(client, small.token)
        alone = [await small_call(client, small.token) for _ in range(args.alone)]
        before, cpu = rss_mb(pid), cpu_s(pid)
        stop, during, peak = asyncio.Event(), [], before

        async def smalls() -> None:
            nonlocal peak
            while not stop.is_set():
                during.append(await small_call(client, small.token))
                peak = max(peak, rss_mb(pid))
                await asyncio.sleep(0.01)

        runner = asyncio.create_task(smalls())
        t0 = time.perf_counter()
        # sent from a thread of their own (a blocking client: sockets let go of the GIL),
        # so the small calls' own client is not what waits on them
        answers = await asyncio.to_thread(send_all, url, big.token, bodies * args.rounds)
        huge_s = time.perf_counter() - t0
        stop.set()
        await runner
        cpu = cpu_s(pid) - cpu
        after = rss_mb(pid)
        await asyncio.sleep(args.settle)
        settled = rss_mb(pid)
        await small_call(client, small.token)
    await r.aclose()
    sent = len(answers)
    print(
        f"{sent} prompts ({args.prompts} distinct) of {len(bodies[0]) / 1e6:.1f} MB in {huge_s:.1f} s:"
    )
    for status, took, text in answers[: args.prompts]:
        print(f"  {status} in {took:.2f} s: {text}")
    print(f"  the proxy's CPU meanwhile: {cpu:.1f} s ({cpu / sent * 1000:.0f} ms a prompt)")
    took = sorted(a[1] for a in answers)
    print(
        f"  each answered in {took[0]:.2f}-{took[-1]:.2f} s; statuses {sorted({a[0] for a in answers})}"
    )
    print(
        f"small calls alone ({len(alone)}): p50 {pct(alone, 0.5):.1f} ms, "
        f"p99 {pct(alone, 0.99):.1f} ms"
    )
    print(
        f"small calls meanwhile ({len(during)}): p50 {pct(during, 0.5):.1f} ms, "
        f"p99 {pct(during, 0.99):.1f} ms, max {max(during) * 1000:.1f} ms"
    )
    print(
        f"proxy RSS: {before:.0f} MB before, peak seen {peak:.0f} MB, {after:.0f} MB after, "
        f"{settled:.0f} MB {args.settle:.0f} s later"
    )
    print(f"(median small call alone {statistics.median(alone) * 1000:.1f} ms)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=1, help="send the prompts this many times")
    ap.add_argument("--alone", type=int, default=200)
    ap.add_argument("--settle", type=float, default=30.0)
    ap.add_argument("--config", default="{}", help="extra proxy config, JSON")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="polar-bench-huge-"))
    nport, rport = localservers.free_port(), localservers.free_port()
    nats = localservers.start_nats(nport, root / "nats")
    valkey = localservers.start_valkey(rport, root / "valkey")
    nats_url, redis_url = f"nats://127.0.0.1:{nport}", f"redis://127.0.0.1:{rport}/0"
    engine = proxy = None
    try:
        engine = EmbeddedServer(tiny_model_dir(), log_dir=root).wait()
        proxy = start_proxy(
            nats_url, redis_url, engine.url, tiny_model_dir(), root, **orjson.loads(args.config)
        )
        assert proxy.proc is not None
        asyncio.run(run(f"http://127.0.0.1:{proxy.port}", proxy.proc.pid, redis_url, args))
    finally:
        if proxy is not None:
            proxy.stop()
        if engine is not None:
            engine.stop()
        localservers.stop_process(nats.pid)
        localservers.stop_process(valkey.pid)


if __name__ == "__main__":
    main()
