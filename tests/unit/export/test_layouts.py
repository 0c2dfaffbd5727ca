"""Export layouts and writers (no servers): rows from scored trajectories, files read back."""

import msgspec
import orjson
import pytest

from schemas import ImageSpan, Outcome, Trace, Trajectory
from services.export.layouts import Numbering, sft_rows, slime_rows
from services.export.writers import ExportError, JsonlWriter, ParquetWriter


def trace(i: int, *, mask=(0, 1, 1), trainable=True, logprobs=(None, -0.5, -0.25)) -> Trace:
    return Trace(
        trace_id=f"s-0000/{i}",
        chain_id=i,
        prompt_ids=[1, 2],
        response_ids=[30 + i, 31, 32],
        loss_mask=list(mask),
        response_logprobs=list(logprobs),
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        weight_versions=["v3"],
        trainable=trainable,
    )


def scored(reward=1.0, status="ok", outcome=Outcome.COMPLETED, traces=None) -> Trajectory:
    return Trajectory(
        session_id="s-0000",
        task_id="s",
        attempt=1,
        outcome=outcome,
        builder="prefix_merging",
        traces=traces if traces is not None else [trace(0), trace(1)],
        reward=reward,
        eval_status=status,
        metadata={"num_samples": 4, "sample_index": 2},
    )


def test_sft_rows_only_from_passed_sessions():
    rows = sft_rows(scored())
    assert len(rows) == 2
    r = rows[0]
    assert r["tokens"] == [1, 2, 30, 31, 32]
    assert r["loss_mask"] == [0, 0, 0, 1, 1] and r["prompt_length"] == 2
    assert r["messages"][1] == {"role": "assistant", "content": "yo"}
    assert (r["session_id"], r["attempt"], r["trace_id"], r["reward"]) == (
        "s-0000",
        1,
        "s-0000/0",
        1.0,
    )
    assert sft_rows(scored(reward=0.5)) == []
    assert len(sft_rows(scored(reward=0.5), min_reward=0.5)) == 2
    assert sft_rows(scored(reward=None, status="error")) == []


def test_sft_skips_masked_and_untrainable_traces():
    t = scored(traces=[trace(0, mask=(0, 0, 0)), trace(1, trainable=False), trace(2)])
    assert [r["trace_id"] for r in sft_rows(t)] == ["s-0000/2"]


def test_slime_rows():
    rows = slime_rows(scored(reward=0.0, outcome=Outcome.TIMEOUT))
    assert len(rows) == 2
    r = rows[1]
    assert r["rollout_id"] == "s-0000:1:s-0000/1"
    assert (r["group_id"], r["sample_index"], r["status"], r["reward"]) == (
        "s", 2, "truncated", 0.0,
    )  # fmt: skip
    assert r["tokens"] == [1, 2, 31, 31, 32] and r["response_length"] == 3
    assert r["loss_mask"] == [0, 1, 1]
    assert r["rollout_log_probs"] == [0.0, -0.5, -0.25]
    assert r["weight_versions"] == ["v3"] and r["metadata"]["chain_id"] == 1
    assert slime_rows(scored(reward=None, status="error")) == []
    assert slime_rows(scored(reward=0.2), min_reward=0.5) == []


def test_jsonl_round_trip(tmp_path):
    path = tmp_path / "sft.jsonl"
    w = JsonlWriter(path, "sft")
    w.write(sft_rows(scored()))
    w.close()
    back = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert back == sft_rows(scored())


@pytest.mark.parametrize("layout", ["sft", "slime"])
def test_parquet_round_trip(tmp_path, layout):
    pq = pytest.importorskip("pyarrow.parquet")
    rows = (sft_rows if layout == "sft" else slime_rows)(scored())
    path = tmp_path / f"{layout}.parquet"
    w = ParquetWriter(path, layout)
    w.write(rows)
    w.write(rows)
    w.close()
    back = pq.read_table(path).to_pylist()
    assert len(back) == 4
    first = back[0]
    for key, value in rows[0].items():
        if key in ("messages", "tools", "metadata"):
            assert orjson.loads(first[key]) == value  # nested values are JSON text
        else:
            assert first[key] == value, key


def test_parquet_rejects_unknown_layout(tmp_path):
    pytest.importorskip("pyarrow")
    with pytest.raises(ExportError, match="unknown layout 'grpo'"):
        ParquetWriter(tmp_path / "x.parquet", "grpo")


def test_rows_are_plain_json():
    # every value is JSON-native (no Structs leak into rows)
    for rows in (sft_rows(scored()), slime_rows(scored())):
        assert orjson.loads(orjson.dumps(rows)) == rows
        assert msgspec.json.decode(msgspec.json.encode(rows)) == rows


def test_slime_group_ids_stay_consistent_across_a_sessions_traces():
    """Two sessions of one task with two traces each, and another task: one group per
    task whatever the traces, unique row indices, each trace's place in its session."""
    numbering = Numbering()
    a = scored()
    b = msgspec.structs.replace(
        scored(), session_id="s-0001", metadata={"num_samples": 4, "sample_index": 3}
    )
    other = msgspec.structs.replace(scored(), task_id="u", session_id="u-0000")
    rows = [r for t in (a, b, other) for r in slime_rows(t, None, numbering)]
    by_task = {}
    for r in rows:
        by_task.setdefault(r["group_id"], set()).add(r["group_index"])
    assert by_task == {"s": {0}, "u": {1}}
    assert [r["index"] for r in rows] == list(range(6))
    assert [(r["sample_index"], r["trace_index"]) for r in rows[:4]] == [
        (2, 0), (2, 1), (3, 0), (3, 1),
    ]  # fmt: skip


def test_sft_rows_carry_the_tools():
    tools = [{"type": "function", "function": {"name": "sh"}}]
    t = scored(traces=[msgspec.structs.replace(trace(0), tools=tools)])
    (row,) = sft_rows(t)
    assert row["tools"] == tools


def test_a_trace_with_images_names_them_in_its_rows(tmp_path):
    image = ImageSpan(digest="sha256:ab", start=1, length=1)
    with_image = msgspec.structs.replace(trace(0), images=[image])
    t = scored(traces=[with_image, trace(1)])
    sft, slime = sft_rows(t), slime_rows(t)
    assert sft[0]["images"] == [["sha256:ab", 1, 1]] and "images" not in sft[1]
    assert slime[0]["metadata"]["images"] == [["sha256:ab", 1, 1]]
    assert "images" not in slime[1]["metadata"]
    pq = pytest.importorskip("pyarrow.parquet")
    w = ParquetWriter(tmp_path / "sft.parquet", "sft")
    w.write(sft)
    w.close()
    back = pq.read_table(tmp_path / "sft.parquet").to_pylist()
    assert orjson.loads(back[0]["images"]) == [["sha256:ab", 1, 1]] and back[1]["images"] is None
