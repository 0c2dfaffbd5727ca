"""A session's MoE routing as the proxy stores it: a deterministic fake engine's rows,
each call's delta (``proxy.routing.delta``) and its record, for the builders' and the
trainer's tests."""

from __future__ import annotations

import base64
import io

import msgspec
import numpy as np

from proxy.backends.base import RoutingRows
from proxy.routing import MoEShape, delta
from schemas import CompletionRecord, Protocol, UpstreamMode
from schemas.completion import delta_encode
from schemas.routing import RoutedExperts

LAYERS, TOP_K, EXPERTS = 3, 2, 8
SHAPE = MoEShape(experts=EXPERTS, top_k=TOP_K)


def engine_rows(tokens: list[int], seed: int = 0) -> np.ndarray:
    """What a deterministic engine routes: each position's row depends on its prefix only
    (a causal model), here on the token and its position; ``seed`` other weights."""
    out = np.zeros((len(tokens) - 1, LAYERS, TOP_K), dtype=np.int32)
    for q, tok in enumerate(tokens[:-1]):
        for layer in range(LAYERS):
            first = (tok * 7 + q * 3 + layer + seed) % EXPERTS
            out[q, layer] = [first, (first + 1 + layer) % EXPERTS]
    return out


def sglang_b64(rows: np.ndarray) -> str:
    return base64.b64encode(rows.astype("<i4").tobytes()).decode()


def vllm_b64(rows: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, rows.astype(np.uint8), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def rows_of(array: np.ndarray, start: int = 0, dtype: str = "int32") -> RoutingRows:
    return RoutingRows(
        data=array.astype(np.dtype(dtype).newbyteorder("<")).tobytes(),
        dtype=dtype,
        layers=LAYERS,
        top_k=TOP_K,
        start=start,
        rows=len(array),
    )


def record(seq: int, prompt: list[int], output: list[int], prev, routed, **kw) -> CompletionRecord:
    base_seq, base_len, tail = delta_encode(prompt, prev)
    return CompletionRecord(
        session_id="s",
        seq=seq,
        protocol=Protocol.OPENAI_CHAT,
        mode=UpstreamMode.TOKEN,
        model="m",
        prompt_ids=tail,
        prompt_base_seq=base_seq,
        prompt_base_len=base_len,
        output_ids=output,
        output_logprobs=[-0.5] * len(output),
        routing=routed,
        **kw,
    )


def agent_session(n_calls: int = 4, seed_of=lambda i: 0, versions=None):
    """An agent loop through the proxy's routing delta: each prompt is the last prompt +
    output + a tool result; returns records, blobs and the engine's rows per call."""
    blobs: dict[str, bytes] = {}
    records, engine, states = [], [], {}
    prompt = list(range(1000, 1300))
    prev = None
    for seq in range(n_calls):
        output = [2000 + seq * 10 + j for j in range(40)]
        full = engine_rows(prompt + output, seed=seed_of(seq))
        engine.append(full)
        base = prev[0] if prev else None
        shared = len(prev[1]) if prev else 0  # the prompt extends the base's tokens
        version = versions[seq] if versions else "v1"
        d = delta(rows_of(full), SHAPE, base, states.get(base), shared, version)
        name = f"routing/s/0/{seq}"
        blobs[name] = d.data
        states[seq] = d.state
        routed = RoutedExperts(
            object=name,
            start=d.start,
            rows=d.rows,
            layers=LAYERS,
            top_k=TOP_K,
            dtype=d.state.dtype,
            base_seq=d.base_seq,
        )
        kw = {"weight_version": version}
        records.append(record(seq, prompt, output, prev, routed, **kw))
        prev = (seq, prompt + output)
        prompt = prompt + output + [3000 + seq] * 30  # the tool result and glue
    return records, blobs, engine


def record_without_routing(rec: CompletionRecord) -> CompletionRecord:
    return msgspec.structs.replace(rec, routing=None)


async def routed_chain(bus, session_id: str, calls: int):
    """A served session's ``calls`` records, prefix-merged into its one chain, and the
    routing rows that chain names: (records, chain, rows by object)."""
    from schemas import Outcome
    from services.builder.strategies.prefix_merging import PrefixMerging
    from services.client.client import routing_blobs
    from tests.integration.proxy_agents import captured

    records = await captured(bus, session_id, expect=calls)
    [chain], _, _ = PrefixMerging().build(records, {}, Outcome.COMPLETED)
    return records, chain, await routing_blobs(bus, [chain])
