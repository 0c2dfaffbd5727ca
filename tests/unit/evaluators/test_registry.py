"""The evaluator registry (built-ins, module:Class) and the guarded run of one evaluator."""

import asyncio
import time

import pytest

from evaluators import (
    EvalContext,
    EvalResult,
    EvaluatorError,
    create_evaluator,
    default_registry,
    run_evaluator,
)
from evaluators.command import reward_from_json, reward_from_stdout
from schemas import Artifacts, Outcome, TaskRequest, Trajectory

P = "tests.unit.evaluators.plugins"


def ctx(outcome=Outcome.COMPLETED, **config) -> EvalContext:
    t = Trajectory(
        session_id="s-0000", task_id="s", outcome=outcome, builder="per_request", traces=[]
    )
    return EvalContext(
        trajectory=t, artifacts=Artifacts(), task=TaskRequest(instruction="x"), config=config
    )


def test_builtins_and_fresh_instances():
    reg = default_registry()
    assert reg.names() == [
        "command",
        "exact_answer",
        "harbor",
        "rubric",
        "session_completed",
        "swebench",
        "test_on_output",
    ]
    assert create_evaluator(reg, "command") is not create_evaluator(reg, "command")
    assert create_evaluator(reg, "session_completed").needs_runtime == "none"
    assert create_evaluator(reg, "test_on_output").needs_runtime == "task"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "nope",
            "unknown evaluator 'nope': use one of command, exact_answer, harbor, rubric, session_completed",
        ),
        ("no_such_pkg_x:Cls", "cannot import module 'no_such_pkg_x'"),
        (f"{P}:Missing", "has no callable 'Missing'"),
        (f"{P}:NotAnEvaluator", "has no `async def evaluate(ctx)`"),
    ],
)
def test_bad_names_say_why(name, message):
    with pytest.raises(EvaluatorError, match=message.replace("(", r"\(").replace(")", r"\)")):
        create_evaluator(default_registry(), name)


async def run(name: str, c: EvalContext, timeout: float = 5.0) -> EvalResult:
    return await run_evaluator(create_evaluator(default_registry(), name), c, timeout, name)


async def test_session_completed():
    assert (await run("session_completed", ctx())).reward == 1.0
    r = await run("session_completed", ctx(Outcome.TIMEOUT))
    assert (r.status, r.reward, r.reason) == ("ok", 0.0, "session ended timeout")


async def test_crash_is_an_explicit_error():
    r = await run(f"{P}:Crashing", ctx())
    assert r.status == "error" and r.reward is None
    assert r.reason == f"evaluator '{P}:Crashing' raised ValueError: grader exploded"


async def test_timeout_is_an_explicit_error():
    started = time.monotonic()
    r = await run(f"{P}:Sleeping", ctx(sleep=30), timeout=0.3)
    assert time.monotonic() - started < 10  # the timeout's, not the 30 s sleep's
    assert (r.status, r.reward) == ("error", None)
    assert r.reason == f"evaluator '{P}:Sleeping' timed out after 0.3s"


async def test_unusable_returns_are_errors():
    r = await run(f"{P}:BadReturn", ctx())
    assert r.status == "error" and "returned float, not EvalResult" in r.reason
    r = await run(f"{P}:NanReward", ctx())
    assert r.status == "error" and "returned reward nan" in r.reason


async def test_an_evaluator_own_timeout_error_is_not_called_a_timeout():
    class Raises:
        needs_runtime = "none"

        async def evaluate(self, c):
            raise TimeoutError("upstream grader timed out")

    r = await run_evaluator(Raises(), ctx(), 5.0, "raises")
    assert r.reason == "evaluator 'raises' raised TimeoutError: upstream grader timed out"


async def test_runtime_evaluators_without_runtime_error_out():
    r = await run("command", ctx(command="true"))
    assert r.status == "error" and "needs a runtime" in r.reason


async def test_cancellation_propagates():
    task = asyncio.create_task(run(f"{P}:Sleeping", ctx(sleep=30)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_command_reward_parsing():
    assert reward_from_stdout("running\n0.75\n\n", "reward") == 0.75
    assert reward_from_stdout('x\n{"reward": 1}\n', "reward") == 1.0
    assert reward_from_stdout('{"score": {"total": 0.5}}', "score.total") == 0.5
    assert reward_from_json({"a": {"b": 2}}, "a.b") == 2.0
    for out, message in [
        ("", "printed nothing"),
        ("done", "neither a number nor JSON"),
        ('{"score": 1}', "no key 'reward'"),
        ('{"reward": "high"}', "is 'high', not a number"),
        ('{"reward": true}', "not a number"),
        ("nan", "not a finite number"),
    ]:
        with pytest.raises(EvaluatorError, match=message):
            reward_from_stdout(out, "reward")
