"""The builder registry: built-ins, duplicates, custom builders by module:Class."""

import pytest

from schemas import Outcome
from services.builder.strategies import BuildError, builder_registry, default_registry
from services.builder.strategies.per_request import PerRequest
from services.builder.strategies.prefix_merging import PrefixMerging
from tests.unit.builder.synth import Capture

HERE = "tests.unit.builder.custom_builders"


def test_default_registry_has_the_built_ins_and_is_not_shared():
    a, b = default_registry(), default_registry()
    assert a.names() == ["per_request", "prefix_merging"]
    assert isinstance(a.create("per_request"), PerRequest)
    assert isinstance(a.create("prefix_merging"), PrefixMerging)
    a.register("mine", PerRequest)
    assert "mine" not in b.names()  # nothing global: each registry is its own
    assert builder_registry().names() == []


def test_register_raises_on_duplicates_and_reserved_names():
    reg = default_registry()
    with pytest.raises(BuildError, match="already registered"):
        reg.register("per_request", PerRequest)
    with pytest.raises(BuildError, match="must not contain ':'"):
        reg.register("a:b", PerRequest)


def test_unknown_name_lists_the_choices():
    with pytest.raises(
        BuildError, match="use one of per_request, prefix_merging, or 'module:Class'"
    ):
        default_registry().create("prefix_merge")


def test_custom_builder_by_module_and_class():
    builder = default_registry().create(f"{HERE}:LastOnly")
    cap = Capture(delta=False)
    cap.call([1, 2], [3])
    cap.call([1, 2, 3, 4], [5])
    traces, stats = builder.build(cap.records, {}, Outcome.COMPLETED)
    assert traces[0].response_ids == [5] and stats.completions == 2


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_pkg.builders:X", "cannot import module 'no_such_pkg.builders'.*PYTHONPATH"),
        (f"{HERE}:Missing", f"module '{HERE}' has no callable 'Missing'; check the name"),
        (f"{HERE}:NotABuilder", "is not a builder: it must be a class with a build"),
        ("bad path:X", "is not of the form 'package.module:ClassName'"),
    ],
)
def test_custom_builder_errors_say_how_to_fix(path, message):
    with pytest.raises(BuildError, match=message):
        default_registry().create(path)
