"""MoE expert routing (R3) in token mode: ask the engine, store only what is new, record.

A call's routing rows cover positions ``[0, P + N - 1)`` of its prompt + output
(``schemas/routing.py``). An agent's next call repeats all of them but the last few in
its prompt, so a record stores only the rows past what its base (the call whose tokens
the prompt extends) already holds, "delta R3":

* an engine that returns every row (SGLang, the embedded one): the shared rows are
  compared with the base's, a block of ``ROUTING_BLOCK`` rows at a time by digest (the
  state keeps 8 bytes per block, not the rows), and rows are stored from the first block
  that differs. Reconstructed routing is therefore exactly what the engine returned.
* an engine that takes a start (vLLM's ``routed_experts_prompt_start``) is asked from the
  block the base's rows end in, and vouches for the rows before it: they are taken from
  the base only when the same weights computed both (a weight update empties the
  engine's cache, and the prefix is computed again), else marked absent.

Dense models never get here: routing is asked only when the topology turns it on.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import msgspec

from proxy.backends.base import Generation, RoutingAsk, RoutingRows
from proxy.backends.routed import decoded
from schemas import subjects as S
from schemas.routing import DTYPES, RoutedExperts

# Rows a call's delta is worked out from off the event loop, past this size (a 20k-token
# call of a 48-layer top-8 model: ~8 MB narrowed, ~10 ms: tests/bench/bench_routing.py)
OFF_LOOP_BYTES = 1 << 20
ROUTING_BLOCK = 64  # rows a digest covers: 8 bytes of state per 64 positions
_DIGEST = 8


class RoutingState(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """What a call's TITO state keeps of its routing, for the call that continues it."""

    rows: int  # positions [0, rows) have routing through this call's record and its bases
    digests: bytes  # one per full block of those rows, in order
    version: str | None  # the weights that computed its rows: the call's last version
    dtype: str
    layers: int
    top_k: int


class MoEShape(msgspec.Struct, frozen=True, kw_only=True):
    experts: int
    top_k: int

    @property
    def dtype(self) -> str:
        """The narrowest id type the schema has for this many experts."""
        return "uint8" if self.experts <= 256 else "uint16" if self.experts <= 65536 else "int32"


_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def moe_shape(model_dir: str | Path | None) -> MoEShape | None:
    """The model's experts and experts per token from its ``config.json`` (the text
    config of a multimodal one); None for a dense model or no model dir."""
    if not model_dir:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None
    for cfg in (config, config.get("text_config") or {}):
        experts = next((cfg[k] for k in _EXPERT_KEYS if isinstance(cfg.get(k), int)), 0)
        top_k = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")
        if experts > 0 and isinstance(top_k, int) and top_k > 0:
            return MoEShape(experts=experts, top_k=top_k)
    return None


def block_digests(data: bytes | memoryview, row_bytes: int) -> bytes:
    """An 8-byte digest per full block of ``ROUTING_BLOCK`` rows."""
    block = ROUTING_BLOCK * row_bytes
    view = memoryview(data)
    return b"".join(
        hashlib.sha1(view[at : at + block]).digest()[:_DIGEST]  # SHA-NI: ~2x blake2b
        for at in range(0, len(view) - block + 1, block)
    )


def _narrow(rows: RoutingRows, dtype: str) -> RoutingRows:
    """SGLang's int32 ids as the model's narrowest type (a quarter of the bytes for up to
    256 experts); an id that does not fit keeps the engine's type."""
    if rows.dtype == dtype or not rows.data:
        return rows
    import numpy as np

    wide = np.frombuffer(rows.data, dtype=np.dtype(rows.dtype).newbyteorder("<"))
    target = np.dtype(dtype).newbyteorder("<")
    if wide.size and (wide.min() < 0 or wide.max() > np.iinfo(target).max):
        return rows
    return msgspec.structs.replace(rows, data=wide.astype(target).tobytes(), dtype=dtype)


def _usable(state: RoutingState | None, rows: RoutingRows) -> bool:
    return state is not None and (state.dtype, state.layers, state.top_k) == (
        rows.dtype,
        rows.layers,
        rows.top_k,
    )


def _leading_equal(a: bytes, b: bytes, blocks: int) -> int:
    n = 0
    while n < blocks and a[n * _DIGEST : (n + 1) * _DIGEST] == b[n * _DIGEST : (n + 1) * _DIGEST]:
        n += 1
    return n


class Delta(msgspec.Struct, frozen=True, kw_only=True):
    """What a call stores of its routing, and what its state keeps."""

    data: bytes
    start: int
    rows: int
    base_seq: int | None
    state: RoutingState


def delta(
    rows: RoutingRows,
    shape: MoEShape,
    base_seq: int | None,
    base: RoutingState | None,
    shared: int,
    version: str | None,
) -> Delta:
    """The rows a call stores, given its base's routing state and how many leading ids
    its prompt shares with the base's prompt + output (plain function: tested alone)."""
    rows = _narrow(decoded(rows), shape.dtype)
    row_bytes = rows.layers * rows.top_k * DTYPES[rows.dtype]
    if base_seq is None or base is None or not _usable(base, rows):
        base = None
    if rows.start == 0:  # every row came back: keep the base's where they are the same
        digests = block_digests(rows.data, row_bytes) if row_bytes else b""
        keep = 0
        if base is not None:
            limit = min(shared, base.rows, rows.rows) // ROUTING_BLOCK
            keep = _leading_equal(digests, base.digests, limit) * ROUTING_BLOCK
        stored = rows.data[keep * row_bytes :]
        start, covered = keep, rows.rows
    else:  # rows from ``start`` on: the engine vouches for the ones before, the base's,
        # when the same weights computed them
        if base is not None and (base.version != version or rows.start > min(shared, base.rows)):
            base = None
        keep, stored, start = (rows.start if base else 0), rows.data, rows.start
        own = block_digests(rows.data, row_bytes) if row_bytes and base else b""
        digests = base.digests[: rows.start // ROUTING_BLOCK * _DIGEST] + own if base else b""
        covered = rows.start + rows.rows if base else 0  # 0: the next call asks for all
    state = RoutingState(
        rows=covered,
        digests=digests,
        version=version,
        dtype=rows.dtype,
        layers=rows.layers,
        top_k=rows.top_k,
    )
    return Delta(
        data=stored,
        start=start,
        rows=rows.rows - (keep if rows.start == 0 else 0),
        base_seq=base_seq if keep else None,
        state=state,
    )


def ask(shape: MoEShape, base: RoutingState | None, shared: int | None) -> RoutingAsk:
    """Rows from the block the base's rows end in (engines that return all ignore it)."""
    start = 0
    if base is not None and shared:
        start = min(shared, base.rows) // ROUTING_BLOCK * ROUTING_BLOCK
    return RoutingAsk(start=start, top_k=shape.top_k)


class RoutingCapture:
    """The proxy's routing side: what to ask, and the rows stored before the record."""

    def __init__(self, shape: MoEShape, blobs) -> None:
        self.shape = shape
        self._blobs = blobs  # async () -> nats ObjectStore (``Bus.blobs``)

    def ask(self, base: RoutingState | None, shared: int | None) -> RoutingAsk:
        return ask(self.shape, base, shared)

    async def store(
        self,
        session_id: str,
        attempt: int,
        seq: int,
        gen: Generation,
        base_seq: int | None,
        base: RoutingState | None,
        shared: int,
    ) -> tuple[RoutedExperts, RoutingState]:
        """Store the call's new rows (before its record: a record never names rows
        nobody can read) and say what the record and the state keep."""
        assert gen.routing is not None
        # the rows are the call's last weights' (an engine recomputes its cache when its
        # weights change: after a swap mid-call every row is the new weights')
        args = (gen.routing, self.shape, base_seq, base, shared, gen.weight_version)
        size = len(gen.routing.data) + len(gen.routing.encoded)
        if size > OFF_LOOP_BYTES:  # base64, numpy and hashlib let go of the GIL
            d = await asyncio.to_thread(delta, *args)
        else:
            d = delta(*args)
        name = S.routing_object(session_id, attempt, seq)
        await (await self._blobs()).put(name, d.data)
        routed = RoutedExperts(
            object=name,
            start=d.start,
            rows=d.rows,
            layers=d.state.layers,
            top_k=d.state.top_k,
            dtype=d.state.dtype,
            base_seq=d.base_seq,
        )
        return routed, d.state
