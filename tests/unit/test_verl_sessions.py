"""The verl adapter's Polar side (services/trainer/adapters/verl_sessions.py): tasks out
of verl's samples, sessions back as ``AgentLoopOutput`` fields, which sessions leave
their group, and the import boundary that lets it run in verl's own venv. No verl here:
tests/integration/test_verl_agent_loop.py drives the real one."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

from infra import verl
from schemas import Outcome, Trace, Trajectory, VersionSpan
from services.trainer.adapters.verl_sessions import (
    Limits,
    PolarError,
    VerlSettings,
    baseline,
    exclusion,
    instruction_of,
    masked_fields,
    merged,
    output_fields,
    task_request,
    versions,
    wait_limit,
)

ADAPTERS = Path(__file__).resolve().parents[2] / "services" / "trainer" / "adapters"
TEMPLATE = {
    "timeout_seconds": 600,
    "agent": {"harness": "shell", "command": "python3 agent.py", "env": {"A": "1"}},
    "evaluator": {"name": "command", "config": {"command": "python3 score.py"}},
}


def trace(response=(5, 6, 7, 8), mask=(1, 1, 0, 1), spans=(("3", 0, 4),), **kw) -> Trace:
    return Trace(
        trace_id="t0",
        prompt_ids=[1, 2, 3],
        response_ids=list(response),
        loss_mask=list(mask),
        response_logprobs=[-0.5 if m else None for m in mask],
        version_spans=[VersionSpan(version=v, start=a, end=b) for v, a, b in spans],
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        **kw,
    )


def session(outcome=Outcome.COMPLETED, reward=0.5, traces=None, **kw) -> Trajectory:
    return Trajectory(
        session_id="task-0001",
        task_id="task",
        outcome=outcome,
        builder="prefix_merging",
        traces=[trace()] if traces is None else traces,
        reward=reward,
        eval_status=kw.pop("eval_status", "ok"),
        **kw,
    )


def test_a_sample_becomes_one_task_of_its_group():
    sample = {
        "raw_prompt": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "fix "}, {"text": "calc.py"}]},
        ],
        "uid": "u1",
        "index": 4,
        "extra_info": {"polar_task": {"agent": {"env": {"B": "2"}}, "priority": 5}},
    }
    req = task_request(TEMPLATE, sample, "verl-x-000001", 8)
    assert req["instruction"] == "fix calc.py" and req["num_samples"] == 8
    assert req["task_id"] == "verl-x-000001" and req["priority"] == 5
    assert req["agent"]["env"] == {"A": "1", "B": "2"}  # merged, not replaced
    assert req["agent"]["command"] == "python3 agent.py"
    assert req["metadata"] == {"verl_uid": "u1", "verl_index": 4}
    with pytest.raises(PolarError, match="num_samples"):
        task_request(TEMPLATE, sample, "verl-x-000002", 0)
    as_json = {**sample, "extra_info": {"polar_task": '{"priority": 7}'}}  # make_data.py's
    assert task_request(TEMPLATE, as_json, "verl-x-000003", 2)["priority"] == 7


def test_merged_and_instructions():
    assert merged({"a": {"b": 1, "c": 2}, "d": 1}, {"a": {"c": 3}, "d": [2]}) == {
        "a": {"b": 1, "c": 3},
        "d": [2],
    }
    assert instruction_of("plain") == "plain"
    with pytest.raises(PolarError, match="no user message"):
        instruction_of([{"role": "system", "content": "x"}])


def test_a_session_becomes_verl_output_fields():
    t = session(traces=[trace(), trace(response=(9,), mask=(1,), side_call="title")])
    f = output_fields(t, Limits(prompt=16, response=16), global_steps=2, seconds=1.5)
    assert f["prompt_ids"] == [1, 2, 3] and f["response_ids"] == [5, 6, 7, 8]
    assert f["response_mask"] == [1, 1, 0, 1]
    assert f["response_logprobs"] == [-0.5, -0.5, 0.0, -0.5]
    assert f["reward_score"] == 0.5 and f["num_turns"] == 2
    assert f["metrics"] == {"generate_sequences": 1.5, "tool_calls": 0.0}
    extra = f["extra_fields"]
    assert extra["polar_session_id"] == "task-0001" and extra["polar_outcome"] == "completed"
    assert (extra["min_global_steps"], extra["max_global_steps"]) == (3, 3)
    assert extra["polar_version_spans"] == [["3", 0, 4]] and extra["polar_cut"] == [0, 0]
    assert "routed_experts" not in f


def test_verl_widths_cut_a_long_trace_as_verl_cuts_its_own():
    f = output_fields(session(), Limits(prompt=2, response=3))
    assert f["prompt_ids"] == [2, 3] and f["response_ids"] == [5, 6, 7]
    assert f["response_mask"] == [1, 1, 0] and f["extra_fields"]["polar_cut"] == [1, 1]


def test_versions_as_verl_counts_them():
    assert versions(trace(spans=(("4", 0, 2), ("5", 2, 4))), 0) == (4, 5, True)
    assert versions(trace(spans=(("default", 0, 4),)), 9) == (9, 9, False)
    assert versions(trace(spans=()), 1) == (1, 1, False)


@pytest.mark.parametrize(
    ("t", "why"),
    [
        (None, "missing"),
        (session(Outcome.ERROR, 0.0, [], metadata={"finish_reason": "init failed"}), "failed"),
        (session(Outcome.CANCELLED, 0.0), "cancelled"),
        (session(reward=None, eval_status="error", eval_reason="boom"), "evaluation failed"),
        (session(traces=[trace(mask=(0, 0, 0, 0))]), "sampled nothing"),
    ],
)
def test_sessions_that_cannot_stand_in_their_group(t, why):
    assert exclusion(t).startswith(why)


def test_a_timed_out_session_stands_and_the_baseline_skips_the_rest():
    timed_out = session(Outcome.TIMEOUT, 0.0)
    assert exclusion(timed_out) is None
    members = [session(reward=1.0), timed_out, session(Outcome.ERROR, 0.0, []), None]
    assert baseline(members) == 0.5
    assert baseline([None]) == 0.0
    masked = masked_fields(members[2], "failed: x", 0.5, pad_id=7, global_steps=3)
    assert masked["response_mask"] == [0] and masked["prompt_ids"] == [7]
    assert masked["reward_score"] == 0.5 and masked["extra_fields"]["polar_excluded"] == "failed: x"
    assert masked["extra_fields"]["min_global_steps"] == 3


def test_settings_refuse_unknown_keys_and_modes():
    with pytest.raises(msgspec.ValidationError, match="groups"):
        msgspec.convert({"groups": 1}, VerlSettings)
    with pytest.raises(ValueError, match="failed"):
        VerlSettings(failed="drop")
    assert wait_limit({"timeout_seconds": 100, "max_retries": 1}, 30.0) == 430.0


def polar_imports(path: Path) -> set[str]:
    """The Polar modules a file imports (schemas, services, proxy, infra, evaluators)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    top = ("schemas", "services", "proxy", "infra", "evaluators")
    return {m for m in out if m.split(".")[0] in top}


def test_the_adapter_imports_only_the_client_side():
    """What runs in verl's venv names only ``schemas`` and ``services.client`` of Polar
    (the integration test checks what that loads there)."""
    allowed = ("schemas", "services.client", "services.trainer.adapters.verl_sessions")
    for name in ("verl_sessions.py", "verl_agent_loop.py"):
        stray = [m for m in polar_imports(ADAPTERS / name) if not m.startswith(allowed)]
        assert stray == [], (name, stray)


def test_the_venv_gets_the_main_venvs_torch_and_verl_without_its_requirements():
    commands = verl.install_commands(Path("/tmp/v"), python="py")
    assert commands[0] == ["py", "-m", "venv", "/tmp/v"]
    assert commands[1][-1] == verl.torch_requirement() and "==" in commands[1][-1]
    assert "--no-deps" in commands[2] and f"verl=={verl.VERL_VERSION}" in commands[2]
    assert {"msgspec", "nats-py", "orjson"} <= set(commands[3])
    names = {d.split("=")[0] for d in commands[3]}
    assert not names & {"torch", "wandb", "tensorboard", "vllm", "sglang"}


def test_moe_routing_goes_to_verl_as_the_leading_rows_polar_has():
    """R3: positions 0..5 of a 7-token trace have rows (the last token never has one);
    verl gets those rows, placed from the prompt's first token, and zero-fills the rest."""
    import numpy as np

    from schemas.routing import RoutingSegment, TraceRouting

    rows = np.arange(6 * 2 * 2, dtype=np.uint8).reshape(6, 2, 2)
    routing = TraceRouting(
        layers=2,
        top_k=2,
        dtype="uint8",
        segments=[RoutingSegment(object="r0", row=0, start=0, length=6, version="3")],
    )
    t = session(traces=[trace(routing=routing)])
    f = output_fields(t, Limits(prompt=8, response=8), routing={"r0": rows.tobytes()})
    assert f["routed_experts"].shape == (6, 2, 2)
    assert (f["routed_experts"] == rows).all()
    cut = output_fields(t, Limits(prompt=2, response=8), routing={"r0": rows.tobytes()})
    assert "routed_experts" not in cut  # a cut prompt's rows would not line up


def test_setup_finds_the_verl_venv_another_checkout_built(tmp_path, monkeypatch):
    """`just setup verl` once per user: a second checkout links the cached venv, no pip."""
    import sys

    from infra import setup

    name = f"verl-{verl.VERL_VERSION}-py{sys.version_info.major}.{sys.version_info.minor}"
    cached = tmp_path / "cache" / name
    (cached / "bin").mkdir(parents=True)
    (cached / "bin" / "python").write_text("")
    site = cached / "lib" / "python3.11" / "site-packages"
    for dist in (f"verl-{verl.VERL_VERSION}", "msgspec-0.19.0", "nats_py-2.16.0"):
        (site / f"{dist}.dist-info").mkdir(parents=True)
    local = tmp_path / "repo" / ".state" / "verl-venv"
    monkeypatch.setattr(verl, "VENV", local)
    monkeypatch.setattr(verl, "VENV_CHOSEN", False)
    monkeypatch.setenv("POLAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(setup, "run", lambda argv, **kw: pytest.fail(f"ran {argv}"))
    res = setup.step_verl()
    assert res.state == "done" and "->" in res.detail
    assert local.is_symlink() and verl.installed_problem(local) is None
    (site / "nats_py-2.16.0.dist-info").rmdir()
    assert "nats_py" in verl.installed_problem(local)
    assert "verl" in setup.STEPS
