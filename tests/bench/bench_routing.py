"""MoE routing (R3) at the proxy, per call of a long agent session: what reading the
engine's rows and storing only the new ones costs, beside what a call's record costs
without them.

A Qwen3-30B-A3B-shaped answer (48 layers, top-8 of 128 experts) for a call whose prompt
extends the previous call's: SGLang's base64 int32 rows decoded (``sglang_rows``), then
``delta`` (narrowed to uint8, 64-row block digests compared with the base's, the new
rows cut out), side by side with vLLM's ``.npy`` rows asked from the base's last block.
Medians of ``--rounds``; one process.

    python tests/bench/bench_routing.py [--prompt 2000 20000 60000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from proxy.backends.base import RoutingAsk  # noqa: E402
from proxy.backends.routed import sglang_rows, vllm_rows  # noqa: E402
from proxy.routing import ROUTING_BLOCK, MoEShape, delta  # noqa: E402

LAYERS, TOP_K, EXPERTS = 48, 8, 128
OUTPUT, NEW = 500, 300  # the call's output, and the tool result its prompt adds


def per_call(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _sglang_call(b64, ask, positions, shape, state, shared):
    return delta(sglang_rows(b64, ask, positions), shape, 0, state, shared, "1")


def _vllm_call(npy, start, positions, shape, state, shared):
    got = vllm_rows(npy, RoutingAsk(start=start, top_k=TOP_K), positions)
    return delta(got, shape, 0, state, shared, "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, nargs="+", default=[2000, 20000, 60000])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    shape = MoEShape(experts=EXPERTS, top_k=TOP_K)
    rng = np.random.default_rng(0)
    print("| prompt tokens | rows | SGLang: decode + delta ms | stored | vLLM: decode + delta ms |")
    print("|---|---|---|---|---|")
    for prompt in args.prompt:
        positions = prompt + OUTPUT - 1
        rows = rng.integers(0, EXPERTS, size=(positions, LAYERS, TOP_K), dtype=np.int32)
        base_rows = positions - OUTPUT - NEW  # the previous call's prompt + output - 1
        base_ask = RoutingAsk(top_k=TOP_K)
        base = sglang_rows(
            base64.b64encode(rows[:base_rows].tobytes()).decode(), base_ask, base_rows
        )
        state = delta(base, shape, None, None, 0, "1").state
        b64 = base64.b64encode(rows.tobytes()).decode()
        shared = base_rows + 1

        sglang = partial(_sglang_call, b64, base_ask, positions, shape, state, shared)

        start = shared // ROUTING_BLOCK * ROUTING_BLOCK
        buf = io.BytesIO()
        np.save(buf, rows[start:].astype(np.uint8), allow_pickle=False)
        npy = base64.b64encode(buf.getvalue()).decode()

        vllm = partial(_vllm_call, npy, start, positions, shape, state, shared)

        d = sglang()
        print(
            f"| {prompt:,} | {positions:,} | {per_call(sglang, args.rounds):.2f} | "
            f"{d.rows:,} rows, {len(d.data) / 1024:.0f} KiB | {per_call(vllm, args.rounds):.2f} |"
        )


if __name__ == "__main__":
    main()
