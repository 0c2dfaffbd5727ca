"""MoE routing delivered to trainers: collate's tensor beside the masks, slime's
``rollout_routed_experts``, the slime export's ``.npy`` reference (no servers; a session's
routing as the proxy stores it, tests/helpers/routing_session.py)."""

from __future__ import annotations

import numpy as np
import pytest

from schemas import Outcome, Trajectory
from services.builder.strategies.prefix_merging import PrefixMerging
from services.export.layouts import slime_rows
from services.export.writers import WRITERS
from services.trainer.adapters.collate import collate
from services.trainer.adapters.slime_rollout import sample_fields
from tests.helpers.routing_session import LAYERS, TOP_K, agent_session


@pytest.fixture
def session():
    records, blobs, engine = agent_session()
    [chain], _, _ = PrefixMerging().build(records, {}, Outcome.COMPLETED)
    return chain, blobs, engine[-1]


def trajectory(chain) -> Trajectory:
    return Trajectory(
        session_id="s",
        task_id="t",
        outcome=Outcome.COMPLETED,
        builder="prefix_merging",
        traces=[chain],
        reward=1.0,
        eval_status="ok",
    )


def test_collate_pads_routing_beside_the_masks(session):
    import msgspec

    chain, blobs, rows = session
    short = msgspec.structs.replace(chain, routing=None, response_ids=chain.response_ids[:5])
    short = msgspec.structs.replace(
        short, loss_mask=chain.loss_mask[:5], response_logprobs=chain.response_logprobs[:5]
    )
    batch = collate([chain, short], pad_id=0, routing=blobs)
    n = len(chain.prompt_ids) + len(chain.response_ids)
    experts, mask = batch["routed_experts"], batch["routing_mask"]
    assert tuple(experts.shape) == (2, n, LAYERS, TOP_K)
    assert np.array_equal(experts[0, : n - 1].numpy(), rows)
    assert mask[0, : n - 1].all() and not mask[0, n - 1]  # the last token: never fed
    assert (experts[1] == -1).all() and not mask[1].any()  # a trace without routing
    assert "routed_experts" not in collate([chain], pad_id=0)  # rows not given: none


def test_slime_sample_gets_rollout_routed_experts(session):
    chain, blobs, rows = session
    fields = sample_fields(trajectory(chain), 0, 0, routing=blobs)
    got = fields["rollout_routed_experts"]
    assert got.dtype == np.int32 and got.shape == (len(fields["tokens"]) - 1, LAYERS, TOP_K)
    assert np.array_equal(got, rows)
    assert "rollout_routed_experts" not in sample_fields(trajectory(chain), 0, 0)


def test_the_slime_export_names_each_rows_routing_file(session, tmp_path):
    chain, _, _ = session
    [row] = slime_rows(trajectory(chain))
    assert row["rollout_routed_experts"] == "routed_experts/s-0-s-0.npy"
    WRITERS["jsonl"](tmp_path / "out.jsonl", "slime").write([row])  # plain JSON still
