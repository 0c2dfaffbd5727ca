"""docs/reference/task.md: every field of a task (``schemas/task.py``), from the code.

Types, defaults and constraints come from ``msgspec.inspect``, each field's text from its
comment, the checks beyond the types from ``__post_init__``, and the evaluators' and
builders' sections from their modules' docstrings.
"""

from __future__ import annotations

import sys

import msgspec
from msgspec import inspect as mi

import schemas.task as task_module
from evaluators.registry import BUILTINS as EVALUATORS
from infra.docgen.source import (
    cell,
    field_annotation_names,
    field_comments,
    markdown,
    named_types,
    own_doc,
    rules,
)
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
    seen: dict[type, mi.StructType] = {}

    def visit(t: mi.Type) -> None:
        if isinstance(t, mi.StructType):
            if t.cls in seen:
                return
            seen[t.cls] = t
            for f in t.fields:
                visit(f.type)
        for child in _children(t):
            visit(child)

    visit(mi.type_info(root))
    return list(seen.values())


def _children(t: mi.Type) -> list[mi.Type]:
    if isinstance(t, mi.Metadata):
        return [t.type]
    if isinstance(t, mi.UnionType):
        return list(t.types)
    if isinstance(t, mi.ListType):
        return [t.item_type]
    if isinstance(t, mi.DictType):
        return [t.key_type, t.value_type]
    return []


def type_text(t: mi.Type) -> str:
    """A type as the JSON it takes, with its constraints."""
    if isinstance(t, mi.Metadata):
        return type_text(t.type)
    if isinstance(t, mi.UnionType):
        return " or ".join(type_text(x) for x in t.types)
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(f"`{msgspec.json.encode(v).decode()}`" for v in t.values)
    if isinstance(t, mi.StructType):
        return f"[{_title(t)}](#{t.cls.__name__.lower()})"
    if isinstance(t, mi.ListType):
        return f"list of {type_text(t.item_type)}"
    if isinstance(t, mi.DictType):
        return f"object of {type_text(t.value_type)}"
    name = _SCALARS.get(type(t), "any JSON value")
    limits = [f"{op} {_num(getattr(t, k))}" for k, op in _LIMITS if getattr(t, k, None) is not None]
    if getattr(t, "pattern", None):
        limits.append(f"matching `{t.pattern}`")
    return ", ".join([name, *limits])


_SCALARS = {
    mi.StrType: "string",
    mi.IntType: "integer",
    mi.FloatType: "number",
    mi.BoolType: "boolean",
    mi.NoneType: "`null`",
}
_LIMITS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))


def _num(v: float) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _title(t: mi.StructType) -> str:
    return t.cls.__name__ if t.tag is None else f"{t.cls.__name__} (`{t.tag}`)"


def default_text(f: mi.Field) -> str:
    if f.required:
        return "**required**"
    value = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
    return f"`{msgspec.json.encode(value).decode()}`"


def description(t: mi.StructType, f: mi.Field) -> str:
    """The field's comment, then the comments of the named types it uses, then the
    built-in names a plugin field takes."""
    cls = t.cls
    texts = [markdown(field_comments(cls).get(f.name, ""))]
    types = named_types(cls.__module__)
    texts += [types[n] for n in sorted(field_annotation_names(cls)[f.name]) if n in types]
    names = BUILTIN_NAMES.get((cls.__name__, f.name))
    if names:
        texts.append("built in: " + ", ".join(f"`{n}`" for n in sorted(names)))
    return "; ".join(x.rstrip(".") for x in texts if x)


def struct_section(t: mi.StructType) -> str:
    out = [f"## {t.cls.__name__}", ""]
    if doc := own_doc(t.cls):
        out += [doc, ""]
    if t.tag is not None:
        out += [f'Chosen by `"{t.tag_field}": "{t.tag}"`.', ""]
    out += ["| field | type | default | description |", "|---|---|---|---|"]
    for f in t.fields:
        row = (f"`{f.encode_name}`", type_text(f.type), default_text(f), description(t, f))
        out.append("| " + " | ".join(cell(x) for x in row) + " |")
    if checks := rules(t.cls):
        out += ["", "Also refused: " + "; ".join(checks) + "."]
    return "\n".join(out)


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
