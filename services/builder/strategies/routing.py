"""A trace's MoE routing: which stored rows hold each of its positions (pure, no reads).

A call's record stores the rows past its base's (``schemas/routing.py``), so the routing
of a call's whole ``prompt + output`` is its own rows, then its base's for the positions
before them, and so on down the chain of bases: segments of objects, never bytes. Both
builders' traces are some call's ``prompt + output`` (a merged chain is its tip's), so a
trace's routing is its last call's. A base's rows are used only for positions its tokens
share with the call (the proxy chose the base as the call whose tokens the prompt
extends), so a retry or a chain break never lends one call's routing to another's tokens.

Which weights computed a row: the call's last version (``weight_version``). An engine
updating its weights recomputes its cache, so after a swap in the middle of a call
every row it returns, those of tokens sampled before the swap too, is the new weights'
(the embedded engine does so; tests/unit/engine/test_moe.py). The trace's
``version_spans`` still say which weights sampled each token: where a token's version is
not its rows' version, its rows are not the ones that sampled it.
"""

from __future__ import annotations

from collections.abc import Mapping

from schemas.routing import RoutingSegment, TraceRouting
from services.builder.strategies.base import Call, common_prefix


def _segment(call: Call, lo: int, hi: int) -> RoutingSegment:
    """Rows ``[lo, hi)`` of ``call``'s own object."""
    r = call.rec.routing
    assert r is not None
    return RoutingSegment(
        object=r.object, row=lo - r.start, start=lo, length=hi - lo, version=call.rec.weight_version
    )


def routing_of(call: Call, calls: Mapping[int, Call]) -> TraceRouting | None:
    """The routing of ``call``'s prompt + output (``calls``: the session's, by seq);
    None when its engine returned none."""
    own = call.rec.routing
    if own is None:
        return None
    shape = (own.layers, own.top_k, own.dtype)
    segments: list[RoutingSegment] = []
    upto = len(call.prompt) + len(call.output) - 1  # the last token was never fed back
    cur: Call | None = call
    seen: set[int] = set()
    while cur is not None and upto > 0 and cur.seq not in seen:
        seen.add(cur.seq)
        r = cur.rec.routing
        if r is None or (r.layers, r.top_k, r.dtype) != shape:
            break
        hi = min(r.start + r.rows, upto)
        if hi > r.start:
            segments.insert(0, _segment(cur, r.start, hi))
        upto = min(upto, r.start)
        base = calls.get(r.base_seq) if r.base_seq is not None else None
        if base is None:
            break
        # the base's rows hold only the positions whose tokens it shares with this call
        # (the record's prompt delta says how many, when it has the same base)
        if cur.rec.prompt_base_seq == base.seq:
            shared = cur.rec.prompt_base_len
        else:
            shared = common_prefix(cur.prompt, base.prompt + base.output)
        upto = min(upto, shared)
        cur = base
    return TraceRouting(layers=own.layers, top_k=own.top_k, dtype=own.dtype, segments=segments)
