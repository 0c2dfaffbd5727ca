"""Custom plugins by ``"module:Class"``: a class of the registry's kind, refused before
anything of it is called (issue 33: ``agent.harness: "os:abort"`` was created, i.e.
called, and killed the pool at every restart; ``evaluator.name: "os:abort"`` the
evaluator)."""

import pytest

from evaluators.base import EvaluatorError
from evaluators.registry import create_evaluator
from evaluators.registry import default_registry as evaluators
from services.builder.strategies import BuildError
from services.builder.strategies import default_registry as builders
from services.common.plugins import PluginError
from services.node.harnesses import default_registry as harnesses
from tests.unit.common import plugin_samples

S = "tests.unit.common.plugin_samples"
REGISTRIES = {"harness": harnesses, "builder": builders, "evaluator": evaluators}
ERRORS = (PluginError, BuildError, EvaluatorError)
NOT_PLUGINS = [
    ("os:abort", "is a builtin_function_or_method, not a class"),
    ("builtins:print", "is a builtin_function_or_method, not a class"),
    (f"{S}:a_function", "is a function, not a class"),
    (f"{S}:NotAPlugin", "is not a"),
    ("no_such_module_xyz:Cls", "cannot import module 'no_such_module_xyz'"),
]
GOOD = {
    "harness": "services.node.harnesses.shell:ShellHarness",
    "builder": "tests.unit.builder.custom_builders:LastOnly",
    "evaluator": "tests.unit.evaluators.plugins:Jitter",
}


@pytest.mark.parametrize("kind", sorted(REGISTRIES))
@pytest.mark.parametrize(("name", "message"), NOT_PLUGINS)
def test_what_is_not_a_plugin_of_its_kind_is_refused_uncalled(kind, name, message):
    plugin_samples.CALLED.clear()
    with pytest.raises(ERRORS, match=message) as refused:
        REGISTRIES[kind]().load_custom(name)
    assert f"custom {kind} {name!r}" in str(refused.value)
    if "not a class" in message:  # it says what it wants instead
        assert "class ('package.module:ClassName')" in str(refused.value)
    assert plugin_samples.CALLED == []


def test_each_kind_says_what_it_expects():
    with pytest.raises(PluginError, match="must be a subclass of Harness"):
        harnesses().load_custom(f"{S}:NotAPlugin")
    with pytest.raises(BuildError, match=r"a class with a build\(records, config, outcome\)"):
        builders().load_custom(f"{S}:NotAPlugin")
    with pytest.raises(PluginError, match=r"no `async def evaluate\(ctx\)`"):
        evaluators().load_custom(f"{S}:NotAPlugin")
    with pytest.raises(PluginError, match="must be a subclass of Harness"):
        harnesses().load_custom(GOOD["evaluator"])  # a plugin, of another kind
    # the evaluator service's own path: an error result, nothing called
    with pytest.raises(EvaluatorError, match="not a class"):
        create_evaluator(evaluators(), "os:abort")


@pytest.mark.parametrize("kind", sorted(REGISTRIES))
def test_a_plugin_of_its_kind_is_created(kind):
    assert REGISTRIES[kind]().create(GOOD[kind]) is not None
