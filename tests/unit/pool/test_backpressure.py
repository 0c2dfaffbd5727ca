"""The backpressure decision and the engines' queue gauges, as plain functions."""

import msgspec
import pytest

from services.pool.backpressure import queue_length, struggling
from services.pool.config import PoolConfig

SGLANG = """# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="qwen",tp_rank="0"} 7.0
sglang:num_queue_reqs{engine_type="unified",model_name="qwen",tp_rank="1"} 5.0
sglang:num_running_reqs{model_name="qwen"} 30.0
"""
VLLM = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 12.0 1712345678000
vllm:num_requests_running{engine="0",model_name="m"} 64.0
"""


def test_queue_length_reads_sglang_and_vllm_gauges():
    assert queue_length(SGLANG) == 12.0  # summed over ranks
    assert queue_length(VLLM) == 12.0  # a trailing timestamp is not the value
    assert queue_length("sglang:num_queue_reqs 3\n") == 3.0  # no labels


def test_queue_length_is_none_without_a_queue_gauge():
    assert queue_length("") is None
    assert queue_length('sglang:num_running_reqs{a="b"} 4\n# sglang:num_queue_reqs 9\n') is None
    assert queue_length('sglang:num_queue_reqs{a="}"} NaNx\n') is None  # unparsable


@pytest.mark.parametrize(
    ("queues", "was", "backoff"),
    [
        ([0.0, 2.0], False, False),
        ([20.0, 14.0], False, True),  # mean 17 > high 16
        ([16.0], False, False),  # at the threshold: not yet
        ([10.0], True, True),  # backing off: holds until at or below low
        ([4.0], True, False),
        ([None, 30.0], False, True),  # an engine without a signal is left out
        ([None, None], True, False),  # no signal at all: never blocks the pipeline
        ([], False, False),
    ],
)
def test_struggling_has_hysteresis(queues, was, backoff):
    assert struggling(queues, high=16.0, low=4.0, was=was) is backoff


def test_pool_watches_the_topology_backends_and_its_own_urls():
    cfg = msgspec.convert(
        {
            "engine_urls": ["http://gpu1:30000"],
            "backends": [{"kind": "sglang", "url": "http://gpu1:30000"}, {"kind": "embedded"}],
        },
        PoolConfig,
    )
    assert cfg.watched_engines() == ["http://gpu1:30000", "http://127.0.0.1:30000"]
    assert PoolConfig().watched_engines() == []  # nothing to watch: off
