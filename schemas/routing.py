"""Mixture-of-experts routing (R3: rollout routing replay), captured per token.

An MoE engine can say which experts its router picked for every token it processed:
per position, per MoE layer (in model order), the ``top_k`` expert ids in the router's
order (highest weight first). Replaying those picks in the training forward pass makes the
trainer's policy the one that sampled the tokens (docs/training.md).

Position ``q`` is a token of the call's ``prompt + output``. The engine computes row
``q`` when it feeds token ``q``, so a call has rows for positions ``[0, len(prompt) +
len(output) - 1)``: the last sampled token was never fed back.

Rows are stored in the object store (``subjects.routing_object``), never in the record:
``len(rows) * layers * top_k`` ids of ``dtype``, little-endian, C order. A call stores only
the rows new to its session's history ("delta R3"): rows before ``RoutedExperts.start``
are those of the record ``base_seq`` (the record whose tokens its prompt extends), which
the proxy checked or the engine vouched for. A trace names its routing as segments of such
objects (``TraceRouting``); ``routing_array`` reads them into one array.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from msgspec import Struct

# dtype name -> bytes per id; the engine's own choice is kept (vLLM: uint8 up to 256
# experts, else uint16; SGLang: int32)
DTYPES: dict[str, int] = {"uint8": 1, "uint16": 2, "int32": 4}
NO_ROUTING = -1  # what ``routing_array`` writes where a position has no routing


class RoutedExperts(Struct, frozen=True, kw_only=True):
    """A call's expert routing: rows for positions ``[start, start + rows)`` of its
    ``prompt + output``, in the object store under ``object``."""

    object: str  # subjects.routing_object(session, attempt, seq)
    start: int  # the first position with a row here (those before: base_seq's)
    rows: int  # rows stored
    layers: int  # MoE layers, in model order
    top_k: int  # experts per token and layer
    dtype: str  # a key of DTYPES
    # rows [0, start) are this record's rows at the same positions (its prompt shares them);
    # None with start > 0: the positions before start have no routing (e.g. the engine
    # computed them under other weights than the base's)
    base_seq: int | None = None

    @property
    def nbytes(self) -> int:
        return self.rows * self.layers * self.top_k * DTYPES[self.dtype]


class RoutingSegment(Struct, frozen=True, kw_only=True):
    """Positions ``[start, start + length)`` of a trace's ``prompt_ids + response_ids``
    are rows ``[row, row + length)`` of ``object``, computed by weights ``version``."""

    object: str  # object-store name of the rows (a call's RoutedExperts.object)
    row: int  # the first row of the segment in that object
    start: int  # its first position in prompt_ids + response_ids
    length: int  # positions covered
    version: str | None = None  # the weights that computed them


class TraceRouting(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Where a trace's routing is: positions no segment covers have none (the last
    token, a call whose engine returned none, a prefix computed under other weights)."""

    layers: int  # MoE layers, in model order
    top_k: int  # experts per token and layer
    dtype: str  # a key of DTYPES: the rows' integer type
    segments: list[RoutingSegment] = []  # in position order

    @property
    def covered(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def nbytes(self) -> int:
        return self.covered * self.layers * self.top_k * DTYPES[self.dtype]


def routing_array(
    routing: TraceRouting, length: int, read: Callable[[str], bytes] | Mapping[str, bytes]
) -> tuple[object, object]:
    """``(experts, present)`` for a trace of ``length`` positions: ``experts`` an int32
    numpy array ``[length, layers, top_k]`` (``NO_ROUTING`` where absent), ``present`` a
    bool array ``[length]``. ``read`` gives an object's bytes (a dict, or a function over
    the object store: ``services.client`` has one)."""
    import numpy as np

    get = read.__getitem__ if isinstance(read, Mapping) else read
    experts = np.full((length, routing.layers, routing.top_k), NO_ROUTING, dtype=np.int32)
    present = np.zeros(length, dtype=bool)
    blobs: dict[str, object] = {}
    dtype = np.dtype(routing.dtype).newbyteorder("<")
    for seg in routing.segments:
        if seg.object not in blobs:
            raw = np.frombuffer(get(seg.object), dtype=dtype)
            blobs[seg.object] = raw.reshape(-1, routing.layers, routing.top_k)
        rows = blobs[seg.object]
        end = min(seg.start + seg.length, length)
        if end <= seg.start:
            continue
        experts[seg.start : end] = rows[seg.row : seg.row + end - seg.start]
        present[seg.start : end] = True
    return experts, present
