"""MoE routing capture (proxy/routing.py, proxy/backends/routed.py): what each engine's
answer decodes to, what a call stores ("delta R3"), and that the builders' traces give
back, position for position, what the engine returned."""

from __future__ import annotations

import base64

import msgspec
import numpy as np
import pytest

from proxy.backends import sglang_wire, vllm_wire
from proxy.backends.base import BackendError, RoutingAsk, TokenRequest
from proxy.backends.routed import decoded, sglang_rows, vllm_rows
from proxy.routing import ROUTING_BLOCK, MoEShape, RoutingState, ask, delta, moe_shape
from schemas import Outcome
from schemas.routing import NO_ROUTING, routing_array
from services.builder.strategies.per_request import PerRequest
from services.builder.strategies.prefix_merging import PrefixMerging
from tests.helpers.routing_session import (
    LAYERS,
    SHAPE,
    TOP_K,
    agent_session,
    engine_rows,
    record_without_routing,
    rows_of,
    sglang_b64,
    vllm_b64,
)


# -- the wire ------------------------------------------------------------------------------
def test_sglang_rows_take_their_layers_from_the_row_count():
    rows = engine_rows(list(range(10)))
    got = sglang_rows(sglang_b64(rows), RoutingAsk(top_k=TOP_K), positions=9)
    assert (got.layers, got.top_k, got.start, got.rows, got.dtype) == (LAYERS, TOP_K, 0, 9, "int32")
    assert got.data == b"" and got.encoded  # decoded where the delta is worked out
    data = decoded(got).data
    assert np.array_equal(np.frombuffer(data, "<i4").reshape(9, LAYERS, TOP_K), rows)
    text = "!" * len(sglang_b64(rows))  # the right length, not base64
    with pytest.raises(BackendError, match="not base64"):
        decoded(sglang_rows(text, RoutingAsk(top_k=TOP_K), positions=9))


@pytest.mark.parametrize(
    ("value", "positions", "says"),
    [
        ("not base64!", 9, "0 bytes of base64"),
        (12, 9, "not a base64 string"),
        (base64.b64encode(b"\0" * 20).decode(), 9, "not 9 rows"),
    ],
)
def test_sglang_rows_that_do_not_fit_are_a_bad_response(value, positions, says):
    with pytest.raises(BackendError, match=says) as err:
        sglang_rows(value, RoutingAsk(top_k=TOP_K), positions)
    assert err.value.kind == "bad_response"


def test_vllm_rows_start_where_they_were_asked_and_keep_the_engines_dtype():
    rows = engine_rows(list(range(20)))  # 19 positions
    got = vllm_rows(vllm_b64(rows[5:]), RoutingAsk(start=5, top_k=TOP_K), positions=19)
    assert (got.dtype, got.start, got.rows, got.layers) == ("uint8", 5, 14, LAYERS)
    assert np.array_equal(np.frombuffer(got.data, np.uint8).reshape(14, LAYERS, TOP_K), rows[5:])
    with pytest.raises(BackendError, match="14 were due"):
        vllm_rows(vllm_b64(rows), RoutingAsk(start=5, top_k=TOP_K), positions=19)
    with pytest.raises(BackendError, match="not a .npy"):
        vllm_rows(base64.b64encode(b"junk").decode(), RoutingAsk(top_k=TOP_K), positions=19)


def test_routing_is_asked_only_when_on():
    plain = TokenRequest(session_id="s", input_ids=[1, 2, 3])
    moe = TokenRequest(session_id="s", input_ids=[1, 2, 3], routing=RoutingAsk(start=0, top_k=2))
    assert "return_routed_experts" not in sglang_wire.build_generate_body(plain)
    assert sglang_wire.build_generate_body(moe)["return_routed_experts"] is True
    assert (
        "routed_experts_prompt_start"
        not in vllm_wire.build_generate_body(plain, "m")["sampling_params"]
    )
    body = vllm_wire.build_generate_body(moe, "m")
    assert body["sampling_params"]["routed_experts_prompt_start"] == 0


def test_a_generate_answer_carries_its_rows_only_when_asked():
    tokens = [5, 6, 7, 8, 9]
    meta = {
        "output_token_logprobs": [[-0.1, 8, None], [-0.2, 9, None]],
        "routed_experts": sglang_b64(engine_rows(tokens)),
    }
    req = TokenRequest(session_id="s", input_ids=tokens[:3], routing=RoutingAsk(top_k=TOP_K))
    gen = sglang_wire.parse_generate({"meta_info": meta}, req)
    assert gen.routing is not None and gen.routing.rows == 4
    plain = TokenRequest(session_id="s", input_ids=tokens[:3])
    assert sglang_wire.parse_generate({"meta_info": meta}, plain).routing is None


def test_moe_shape_from_the_model_config(tmp_path):
    (tmp_path / "config.json").write_text('{"num_experts": 128, "num_experts_per_tok": 8}')
    assert moe_shape(tmp_path) == MoEShape(experts=128, top_k=8)
    assert moe_shape(tmp_path).dtype == "uint8"
    (tmp_path / "config.json").write_text(
        '{"text_config": {"n_routed_experts": 300, "num_experts_per_tok": 4}}'
    )
    assert moe_shape(tmp_path).dtype == "uint16"
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    assert moe_shape(tmp_path) is None and moe_shape(None) is None


# -- delta R3 ------------------------------------------------------------------------------
def test_a_call_that_extends_stores_only_the_rows_past_its_base():
    first = list(range(600))
    d1 = delta(rows_of(engine_rows(first)), SHAPE, None, None, 0, "v1")
    assert (d1.start, d1.rows, d1.base_seq) == (0, 599, None)
    assert d1.state.dtype == "uint8" and len(d1.data) == 599 * LAYERS * TOP_K  # narrowed
    second = first + list(range(600, 700))
    d2 = delta(rows_of(engine_rows(second)), SHAPE, 0, d1.state, 600, "v1")
    # whole equal blocks of the 599 shared rows only: 9 of 64
    assert d2.base_seq == 0 and d2.start == 9 * ROUTING_BLOCK == 576
    assert d2.rows == 699 - 576 and d2.state.rows == 699
    # the next call asks an engine that takes a start from the block the base ends in
    assert ask(SHAPE, d2.state, 700).start == 10 * ROUTING_BLOCK


def test_rows_the_engine_routed_otherwise_are_stored_again():
    first = list(range(600))
    d1 = delta(rows_of(engine_rows(first)), SHAPE, None, None, 0, "v1")
    other = engine_rows(first + [1, 2], seed=1)  # other weights: every row differs
    d2 = delta(rows_of(other), SHAPE, 0, d1.state, 600, "v2")
    assert (d2.start, d2.base_seq, d2.rows) == (0, None, 601)


def test_an_engine_that_vouches_for_the_prefix_is_trusted_only_under_the_same_weights():
    base = RoutingState(
        rows=600, digests=b"\1" * 16, version="v1", dtype="uint8", layers=LAYERS, top_k=TOP_K
    )
    tail = engine_rows(list(range(700)))[128:]
    same = delta(rows_of(tail, start=128, dtype="uint8"), SHAPE, 0, base, 650, "v1")
    assert same.base_seq == 0 and same.state.rows == 699
    assert same.state.digests[:16] == base.digests  # the base's blocks, then its own
    swapped = delta(rows_of(tail, start=128, dtype="uint8"), SHAPE, 0, base, 650, "v2")
    assert swapped.base_seq is None and swapped.state.rows == 0  # positions < 128: none


# -- proxy -> records -> builders ------------------------------------------------------
def test_every_trace_gives_back_the_engines_rows_position_for_position():
    records, blobs, engine = agent_session()
    # delta: each later call stores its rows from the last whole block its base holds
    starts = [r.routing.start for r in records]
    assert starts == [0, 320, 384, 448] and [r.routing.base_seq for r in records] == [None, 0, 1, 2]
    assert [r.routing.rows for r in records] == [
        len(e) - a for e, a in zip(engine, starts, strict=True)
    ]
    traces, _ = PerRequest().build(records, {}, Outcome.COMPLETED)
    for trace, rows in zip(traces, engine, strict=True):
        n = len(trace.prompt_ids) + len(trace.response_ids)
        experts, present = routing_array(trace.routing, n, blobs)
        assert present[: n - 1].all() and not present[n - 1]  # the last token: never fed
        assert np.array_equal(experts[: n - 1], rows)
        assert (experts[n - 1] == NO_ROUTING).all()
    [chain], _, _ = PrefixMerging().build(records, {}, Outcome.COMPLETED)
    n = len(chain.prompt_ids) + len(chain.response_ids)
    experts, present = routing_array(chain.routing, n, blobs)
    assert np.array_equal(experts[: n - 1], engine[-1]) and present[: n - 1].all()


def test_a_prefix_routed_under_other_weights_is_never_lent_from_the_base():
    # call 2 ran after a weight update: the engine routed its whole prompt again
    records, blobs, engine = agent_session(
        seed_of=lambda i: 0 if i < 2 else 1, versions=["v1", "v1", "v2", "v2"]
    )
    assert records[2].routing.base_seq is None and records[2].routing.start == 0
    traces, _ = PerRequest().build(records, {}, Outcome.COMPLETED)
    n = len(traces[3].prompt_ids) + len(traces[3].response_ids)
    experts, _ = routing_array(traces[3].routing, n, blobs)
    assert np.array_equal(experts[: n - 1], engine[3])
    assert {s.version for s in traces[3].routing.segments} == {"v2"}


def test_a_call_without_routing_marks_its_positions_absent():
    records, blobs, engine = agent_session()
    no_base = [r if r.seq != 1 else record_without_routing(r) for r in records]
    traces, _ = PerRequest().build(no_base, {}, Outcome.COMPLETED)
    assert traces[1].routing is None
    n = len(traces[2].prompt_ids) + len(traces[2].response_ids)
    experts, present = routing_array(traces[2].routing, n, blobs)
    start = records[2].routing.start
    assert not present[:start].any() and present[start : n - 1].all()  # base gone: absent
    assert np.array_equal(experts[start : n - 1], engine[2][start:])


def test_a_swap_mid_call_labels_the_calls_rows_with_the_weights_after_it():
    # the engine recomputed its cache under v2: every row it returned is v2's, while the
    # version spans keep saying that v1 sampled the first 10 tokens
    records, _, _ = agent_session(n_calls=2)
    swapped = msgspec.structs.replace(
        records[1], weight_version="v2", weight_versions=["v1", "v2"], weight_version_starts=[0, 10]
    )
    traces, _ = PerRequest().build([records[0], swapped], {}, Outcome.COMPLETED)
    versions = [(s.version, s.start) for s in traces[1].routing.segments]
    assert versions == [("v1", 0), ("v2", records[1].routing.start)]
    assert [(v.version, v.start, v.end) for v in traces[1].version_spans] == [
        ("v1", 0, 10),
        ("v2", 10, 40),
    ]


# -- the proxy's routing side: what a call costs when routing cannot be had -----------------
async def test_a_call_without_its_routing_is_recorded_all_the_same(caplog):
    from types import SimpleNamespace

    from proxy import metrics
    from proxy.backends.base import Generation
    from proxy.modes import TokenMode
    from proxy.routing import RoutingCapture
    from proxy.tito import PromptPlan
    from services.common.tokenization import ChatTokenizer
    from tests.helpers.moe_model import moe_model_dir
    from tests.helpers.routing_session import rows_of

    async def refusing_store():
        raise ConnectionError("object store down")

    tok = ChatTokenizer.load(moe_model_dir())
    mode = TokenMode(None, tok, routing=RoutingCapture(SHAPE, refusing_store))
    ctx = SimpleNamespace(session_id="s", attempt=0)
    plan = PromptPlan([1, 2, 3], None, None, None)
    answer = dict(prompt_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-0.1, -0.2])
    missing = metrics.ROUTING.labels("missing").value
    for _ in range(2):  # an engine started without the flag: said once, counted each time
        gen = Generation(**answer, finish_reason="stop", worker="http://e")
        assert await mode.store_routing(ctx, 0, plan, gen) == (None, None)
    assert metrics.ROUTING.labels("missing").value == missing + 2
    assert sum("--enable-return-routed-experts" in r.message for r in caplog.records) == 1

    refused = metrics.ROUTING_NOT_STORED.labels().value
    rows = rows_of(engine_rows([1, 2, 3, 4, 5]))
    gen = Generation(**answer, finish_reason="stop", routing=rows)
    assert await mode.store_routing(ctx, 0, plan, gen) == (None, None)  # the call goes on
    assert metrics.ROUTING_NOT_STORED.labels().value == refused + 1
