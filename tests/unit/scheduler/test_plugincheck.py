"""Submission checks every custom plugin a task names as its service would load it, in a
child process: the scheduler runs no plugin code itself (issue 33: ``os:abort`` as a
harness or an evaluator was accepted, and killed its service at every restart)."""

import asyncio
import sys

import pytest

from services.scheduler.logic import PluginRef
from services.scheduler.plugincheck import PluginCheck

pytestmark = pytest.mark.asyncio
B = "tests.unit.scheduler.bad_imports"


async def test_what_no_service_would_load_is_refused_saying_what_was_expected():
    check = PluginCheck()
    got = await check.verdicts(
        [
            ("harness", "os:abort"),
            ("evaluator", "os:abort"),
            ("evaluator", "builtins:print"),
            ("builder", "os.path:join"),  # a module function
            ("harness", "tests.unit.evaluators.plugins:Jitter"),  # a plugin of another kind
            ("evaluator", "tests.unit.evaluators.plugins:Jitter"),
            ("builder", "tests.unit.builder.custom_builders:LastOnly"),
        ]
    )
    assert got[("harness", "os:abort")] == (
        "custom harness 'os:abort' is a builtin_function_or_method, not a class: name a "
        "harness class ('package.module:ClassName'); it must be a subclass of Harness "
        "(services.node.harnesses.base; CliHarness for an npm CLI)"
    )
    assert "no `async def evaluate(ctx)`" in got[("evaluator", "os:abort")]
    assert (
        "'builtins:print' is a builtin_function_or_method, not a class"
        in got[("evaluator", "builtins:print")]
    )
    assert (
        "'os.path:join' is a function, not a class: name a builder class"
        in got[("builder", "os.path:join")]
    )
    assert (
        "is not a harness: it must be a subclass of Harness"
        in got[("harness", "tests.unit.evaluators.plugins:Jitter")]
    )
    assert got[("evaluator", "tests.unit.evaluators.plugins:Jitter")] is None
    assert got[("builder", "tests.unit.builder.custom_builders:LastOnly")] is None


async def test_the_first_refused_plugin_of_a_task_is_named_by_its_field():
    refs = [
        PluginRef("$.agent.harness", "harness", "noop"),
        PluginRef("$.evaluator.name", "evaluator", "tests.unit.evaluators.plugins:Jitter"),
        PluginRef("$.evaluator.config.base.name", "evaluator", "os:abort"),
    ]
    field, reason = await PluginCheck().refusal(refs)
    assert field == "$.evaluator.config.base.name" and "'os:abort'" in reason
    assert await PluginCheck().refusal(refs[:2]) is None


async def test_a_module_whose_import_kills_or_hangs_is_refused_and_the_scheduler_lives():
    got = await PluginCheck().verdicts(
        [("evaluator", f"{B}.dies:Evaluator"), ("evaluator", f"{B}.hangs:Evaluator")]
    )
    assert got[("evaluator", f"{B}.dies:Evaluator")].startswith(
        "loading it ended the checking process (killed by SIGKILL)"
    )
    # the child died on the first: the second was never looked at, and is not kept
    assert got[("evaluator", f"{B}.hangs:Evaluator")].startswith("not checked")
    # (a short limit, that a loaded machine's child start-up may use up: the same verdict)
    got = await PluginCheck(timeout=2).verdicts([("evaluator", f"{B}.hangs:Evaluator")])
    assert got[("evaluator", f"{B}.hangs:Evaluator")] == (
        "checking it took over 2s (does its import hang?)"
    )
    assert f"{B}.dies" not in sys.modules and f"{B}.hangs" not in sys.modules


async def test_verdicts_are_kept_and_one_child_checks_a_burst(monkeypatch):
    check = PluginCheck()
    children = []
    run_child = check._run_child

    async def counted(keys):
        children.append(keys)
        return await run_child(keys)

    monkeypatch.setattr(check, "_run_child", counted)
    key = ("evaluator", "builtins:print")
    burst = await asyncio.gather(*(check.verdicts([key]) for _ in range(20)))
    assert len({v[key] for v in burst}) == 1 and burst[0][key]
    await check.verdicts([key])  # kept for CACHE_SECONDS
    assert children == [[key]]
