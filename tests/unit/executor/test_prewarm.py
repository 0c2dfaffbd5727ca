"""Evaluator prewarm on a real local runtime: stopped wherever it is, and findable."""

import asyncio

import orjson

from schemas import TaskRequest, decode
from services.node.prewarm import Prewarm, prewarm_runtime_id
from services.runtimes.factory import create_runtime
from tests.unit.runtimes.support import leftovers, settled_leftovers


def spec(prepare: list | None = None, **evaluator) -> TaskRequest:
    raw = {"task_id": "t", "instruction": "x", "evaluator": evaluator}
    raw["runtime"] = {"backend": "local", "prepare": prepare or []}
    return decode(orjson.dumps(raw), TaskRequest)


def test_only_a_prewarmed_fresh_evaluator_has_an_eval_runtime_to_find():
    assert prewarm_runtime_id(spec(runtime="fresh", prewarm=True), "s1", 2) == "s1-a2-eval"
    assert prewarm_runtime_id(spec(runtime="fresh"), "s1", 0) is None
    assert prewarm_runtime_id(spec(runtime="live", prewarm=True), "s1", 0) is None


def prewarm(tmp_path, sid: str, prepare: list) -> Prewarm:
    runtime = spec(prepare).runtime
    return Prewarm(create_runtime(runtime, sid, base_dir=tmp_path, role="eval"), runtime.prepare)


async def test_stop_while_preparing_leaves_nothing(tmp_path):
    pw = prewarm(tmp_path, "pw1", [{"action": "exec", "command": "sleep 300 & sleep 200"}])
    rt = pw.runtime
    assert len(await settled_leftovers(rt.runtime_id, 3)) == 3  # sh + 2 sleeps: mid-prepare
    await pw.stop()
    assert leftovers(rt.runtime_id) == [] and not (tmp_path / rt.runtime_id).exists()


async def test_failed_prepare_is_no_runtime_and_is_stopped(tmp_path):
    pw = prewarm(tmp_path, "pw2", [{"action": "exec", "command": "sleep 300 & exit 4"}])
    rt = pw.runtime
    assert await pw.ready() is None
    assert leftovers(rt.runtime_id) == [] and not (tmp_path / rt.runtime_id).exists()


async def test_ready_runtime_is_handed_over_running(tmp_path):
    pw = prewarm(tmp_path, "pw3", [])
    rt = pw.runtime
    assert await asyncio.wait_for(pw.ready(), 10) is rt and rt.state == "running"
    await pw.stop()  # idempotent, and what a lost finish does
    await pw.stop()
    assert not (tmp_path / rt.runtime_id).exists()
