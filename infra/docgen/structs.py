"""msgspec Structs as reference tables: one section per struct, one row per field with
its JSON type and constraints (``msgspec.inspect``), its default, and its comment in the
source (``source.field_comments``, up the class's bases for an inherited field).

A page documents the structs it reaches from its roots; a struct another page documents
is a link there (``elsewhere``), not a second copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import msgspec
from msgspec import inspect as mi

from infra.docgen.source import (
    cell,
    field_annotation_names,
    field_comments,
    markdown,
    named_types,
    own_doc,
    rules,
)

# Extra text for a field, by (class name, field name): the built-in names a plugin field
# takes, say. A page passes its own.
Extras = Mapping[tuple[str, str], str]


@dataclass(frozen=True)
class Page:
    """Where a struct's section is: ``elsewhere`` maps a struct to the page (relative to
    this one) that documents it; the others are on this page."""

    elsewhere: Mapping[type, str] = field(default_factory=dict)
    extras: Extras = field(default_factory=dict)

    def link(self, cls: type) -> str:
        return f"{self.elsewhere.get(cls, '')}#{anchor(cls)}"


def anchor(cls: type) -> str:
    return cls.__name__.lower()


def walk(roots: Iterable[object], stop: Iterable[type] = ()) -> list[mi.StructType]:
    """The struct types ``roots`` reach, each once, in the order a reader meets them;
    never through a struct of ``stop`` (another page's)."""
    seen: dict[type, mi.StructType] = {}
    stopped = set(stop)

    def visit(t: mi.Type) -> None:
        if isinstance(t, mi.StructType):
            if t.cls in seen or t.cls in stopped:
                return
            seen[t.cls] = t
            for f in t.fields:
                visit(f.type)
        for child in children(t):
            visit(child)

    for root in roots:
        visit(mi.type_info(root))
    return list(seen.values())


def children(t: mi.Type) -> list[mi.Type]:
    if isinstance(t, mi.Metadata):
        return [t.type]
    if isinstance(t, mi.UnionType):
        return list(t.types)
    if isinstance(t, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
        return [t.item_type]
    if isinstance(t, mi.TupleType):
        return list(t.item_types)
    if isinstance(t, mi.DictType):
        return [t.key_type, t.value_type]
    return []


_SCALARS = {
    mi.StrType: "string",
    mi.IntType: "integer",
    mi.FloatType: "number",
    mi.BoolType: "boolean",
    mi.NoneType: "`null`",
    mi.BytesType: "bytes (base64)",
}
_LIMITS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))


def type_text(t: mi.Type, page: Page = Page()) -> str:
    """A type as the JSON it takes, with its constraints."""
    if isinstance(t, mi.Metadata):
        return type_text(t.type, page)
    if isinstance(t, mi.UnionType):
        return " or ".join(type_text(x, page) for x in t.types)
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(_json(v) for v in t.values)
    if isinstance(t, mi.EnumType):
        return "one of " + ", ".join(_json(m.value) for m in t.cls)
    if isinstance(t, mi.StructType):
        return f"[{title(t)}]({page.link(t.cls)})"
    if isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
        return f"list of {type_text(t.item_type, page)}"
    if isinstance(t, mi.TupleType):
        return "[" + ", ".join(type_text(x, page) for x in t.item_types) + "]"
    if isinstance(t, mi.DictType):
        return f"object of {type_text(t.value_type, page)}"
    name = _SCALARS.get(type(t), "any JSON value")
    limits = [f"{op} {_num(getattr(t, k))}" for k, op in _LIMITS if getattr(t, k, None) is not None]
    if getattr(t, "pattern", None):
        limits.append(f"matching `{t.pattern}`")
    return ", ".join([name, *limits])


def _json(v: object) -> str:
    return f"`{msgspec.json.encode(v).decode()}`"


def _num(v: float) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def title(t: mi.StructType) -> str:
    return t.cls.__name__ if t.tag is None else f"{t.cls.__name__} (`{t.tag}`)"


def default_text(f: mi.Field) -> str:
    if f.required:
        return "**required**"
    value = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
    text = _json(value)
    if len(text) > 40 and isinstance(value, msgspec.Struct) and _all_defaults(value):
        return "its fields' defaults"  # the section of its type lists them
    return text


def _all_defaults(value: msgspec.Struct) -> bool:
    try:
        return value == type(value)()
    except (TypeError, ValueError):  # a field is required, or its checks refuse the defaults
        return False


def declaring(cls: type, name: str) -> type:
    """The class among ``cls``'s bases whose body declares field ``name``."""
    for base in cls.__mro__:
        if name in base.__dict__.get("__annotations__", {}):
            return base
    return cls


def field_doc(cls: type, name: str) -> str:
    """The comment on field ``name`` where it is declared (``cls`` or a base)."""
    owner = declaring(cls, name)
    try:
        return markdown(field_comments(owner).get(name, ""))
    except LookupError:  # a base not at the top of its module: no comments to read
        return ""


def description(t: mi.StructType, f: mi.Field, extras: Extras = {}) -> str:  # noqa: B006
    """The field's comment, then the comments of the named types it uses, then what the
    page adds for it."""
    owner = declaring(t.cls, f.name)
    texts = [field_doc(t.cls, f.name)]
    try:
        used = field_annotation_names(owner).get(f.name, set())
    except LookupError:
        used = set()
    types = named_types(owner.__module__)
    texts += [types[n] for n in sorted(used) if n in types]
    if extra := extras.get((t.cls.__name__, f.name)):
        texts.append(extra)
    return "; ".join(x.rstrip(".") for x in texts if x)


def undocumented(types: Iterable[mi.StructType]) -> list[str]:
    """``Class.field`` for each field with no description."""
    return [f"{t.cls.__name__}.{f.name}" for t in types for f in t.fields if not description(t, f)]


def section(
    t: mi.StructType,
    page: Page = Page(),
    level: int = 2,
    fields: Callable[[mi.StructType], list[mi.Field]] = lambda t: list(t.fields),
) -> str:
    out = [f"{'#' * level} {t.cls.__name__}", ""]
    if doc := own_doc(t.cls):
        out += [doc, ""]
    if t.tag is not None:
        out += [f'Chosen by `"{t.tag_field}": "{t.tag}"`.', ""]
    out += ["| field | type | default | description |", "|---|---|---|---|"]
    for f in fields(t):
        row = (
            f"`{f.encode_name}`",
            type_text(f.type, page),
            default_text(f),
            description(t, f, page.extras),
        )
        out.append("| " + " | ".join(cell(x) for x in row) + " |")
    if checks := rules(t.cls):
        out += ["", "Also refused: " + "; ".join(checks) + "."]
    return "\n".join(out)
