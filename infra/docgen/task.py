"""docs/reference/task.md: every field of a task (``schemas/task.py``), from the code.

Types, defaults and constraints come from ``msgspec.inspect``, each field's text from its
comment, the checks beyond the types from ``__post_init__``, and the evaluators' and
builders' sections from their modules' docstrings.
"""

from __future__ import annotations

import sys

from msgspec import inspect as mi

import schemas.task as task_module
from evaluators.registry import BUILTINS as EVALUATORS
from infra.docgen.source import markdown, own_doc
from infra.docgen.structs import Page, section, walk
from infra.docgen.structs import description as structs_description
from schemas.task import BUILTIN_BUILDERS, BUILTIN_EVALUATORS, BUILTIN_HARNESSES, TaskRequest
from services.builder.strategies import default_registry as builders

# Fields whose value names a plugin: the built-in names, listed with the field.
BUILTIN_NAMES = {
    ("AgentSpec", "harness"): BUILTIN_HARNESSES,
    ("BuilderSpec", "name"): BUILTIN_BUILDERS,
    ("EvaluatorSpec", "name"): BUILTIN_EVALUATORS,
}
INTRO = """\
A task is one JSON object (or a YAML file that `polar submit` turns into one): what
`POST /tasks` takes and what `polar.tasks.submit` carries. A key this page does not list
is refused with its path (`$.evaluator.nmae`), at every depth; a refusal names the field.
"""


def structs(root: type = TaskRequest) -> list[mi.StructType]:
    """The task's struct types, each once, in the order a reader meets them."""
    return walk([root])


# Fields whose value names a plugin: the built-in names, listed with the field.
EXTRAS = {
    key: "built in: " + ", ".join(f"`{n}`" for n in sorted(names))
    for key, names in BUILTIN_NAMES.items()
}
PAGE = Page(extras=EXTRAS)


def description(t: mi.StructType, f: mi.Field) -> str:
    """The field's comment, then the comments of the named types it uses, then the
    built-in names a plugin field takes."""
    return structs_description(t, f, EXTRAS)


def struct_section(t: mi.StructType) -> str:
    return section(t, PAGE)


def plugin_sections() -> str:
    out = ["## Built-in evaluators", ""]
    for name, cls in EVALUATORS.items():
        out += [f"### `{name}`", "", markdown(sys.modules[cls.__module__].__doc__ or ""), ""]
    out += ["## Built-in builders", ""]
    registry = builders()
    for name in registry.names():
        cls = type(registry.create(name))
        doc = own_doc(cls) or markdown(sys.modules[cls.__module__].__doc__ or "")
        out += [f"### `{name}`", "", doc, ""]
    return "\n".join(out).rstrip() + "\n"


def render() -> str:
    parts = [
        "# Task reference",
        "",
        INTRO,
        markdown(task_module.__doc__ or "").split("\n\n", 1)[1].strip(),  # past the title
        "",
        *(struct_section(t) + "\n" for t in structs()),
        plugin_sections(),
    ]
    return "\n".join(parts)
