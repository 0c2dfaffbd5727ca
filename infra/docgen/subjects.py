"""docs/reference/subjects.md: every NATS subject, JetStream stream, durable consumer,
object-store name and Redis key (``schemas/subjects.py``, in its own sections and order,
each with its comment or docstring), the streams as ``services/common/bus.py`` declares
them with their default limits, the session states' diagram (``schemas/session.py``'s
``ALLOWED_FROM``) and every event on the bus (``schemas/events.py``).

A name built by a function is shown with its arguments as placeholders:
``task_result(task_id)`` is ``polar.tasks.<task_id>.result``.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass

from nats.js.api import StreamConfig

import schemas.subjects as S
from infra.docgen.source import cell, markdown, module
from infra.docgen.structs import Page, section, undocumented, walk
from schemas.events import Event
from schemas.session import ALLOWED_FROM, LIVE_STATES, TERMINAL_STATES, SessionState
from schemas.trajectory import Trajectory
from services.common.bus import STREAMS
from services.common.settings import DEFAULT_STREAM_LIMITS, OBJECT_STREAM

_SECTION = re.compile(r"^-- (.+?) -+$")  # "# -- subjects ----": the module's sections
PAGE = Page(elsewhere={Trajectory: "trajectory.md"})


@dataclass(frozen=True)
class Name:
    section: str
    symbol: str  # the constant, or the function with its parameters
    value: str  # the name, placeholders for the parameters
    doc: str


def names() -> list[Name]:
    """Every name ``schemas/subjects.py`` defines, in its sections, in order."""
    mod = module(S.__name__)
    source = inspect.getsource(S).splitlines()
    sections = [
        (n, m[1]) for n, text in enumerate(source, 1) if (m := _SECTION.match(text.lstrip("# ")))
    ]
    out = []
    for node in mod.tree.body:
        where = next((t for line, t in reversed(sections) if line < node.lineno), "")
        if (got := _name(node, mod)) is not None:
            out.append(Name(where, *got))
    return out


def _name(node: ast.stmt, mod) -> tuple[str, str, str] | None:
    if isinstance(node, ast.Assign) and isinstance(target := node.targets[0], ast.Name):
        value = getattr(S, target.id)
        if isinstance(value, str) and not target.id.startswith("_"):
            return f"`{target.id}`", value, _documentation(mod, node)
    if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
        fn = getattr(S, node.name)
        params = list(inspect.signature(fn).parameters)
        value = fn(*(f"<{p}>" for p in params))
        if isinstance(value, str):
            doc = inspect.getdoc(fn) or _documentation(mod, node)
            return f"`{node.name}({', '.join(params)})`", value, doc
    return None


def _documentation(mod, node: ast.stmt) -> str:
    """The comments on and right above ``node`` (a section's title is none of them)."""
    return " ".join(mod.above(node.lineno) + mod.trailing(node.lineno, node.end_lineno))


def undocumented_names() -> list[str]:
    return [n.symbol.strip("`") for n in names() if not n.doc.strip()]


def names_section() -> str:
    out: list[str] = []
    current = None
    for n in names():
        if n.section != current:
            current = n.section
            title = current[:1].upper() + current[1:]
            out += ["", f"## {title}", "", "| name | in the code | what it is |", "|---|---|---|"]
        out.append(f"| {cell(f'`{n.value}`')} | {cell(n.symbol)} | {cell(markdown(n.doc))} |")
    return "\n".join(out).lstrip("\n")


def _duration(seconds: float | None) -> str:
    if not seconds:
        return "none"
    days = seconds / 86400
    return f"{days:g} days" if days >= 1 else f"{seconds:g} s"


def _size(n: int) -> str:
    return "none" if n < 0 else f"{n / (1 << 30):g} GiB"


def stream_row(cfg: StreamConfig) -> str:
    limits = DEFAULT_STREAM_LIMITS.get(cfg.name or "")
    retention = getattr(cfg.retention, "value", cfg.retention) or "limits"
    row = (
        f"`{cfg.name}`",
        ", ".join(f"`{s}`" for s in cfg.subjects or []),
        str(retention),
        _duration(cfg.duplicate_window),
        _duration(limits.max_age_seconds) if limits else "none (a work queue)",
        _size(limits.max_bytes) if limits else "none",
    )
    return "| " + " | ".join(cell(x) for x in row) + " |"


def streams_section() -> str:
    out = [
        "## Streams as declared",
        "",
        "Every service declares these at its start (`services/common/bus.py`); the age and"
        " size limits are the default retention policy, which the topology's `retention`"
        " overrides per stream ([Retention](topology.md#retention)).",
        "",
        "| stream | subjects | retention | dedupe window | max age | max bytes |",
        "|---|---|---|---|---|---|",
        *(stream_row(cfg) for cfg in STREAMS),
    ]
    blobs = DEFAULT_STREAM_LIMITS[OBJECT_STREAM]
    out += [
        "",
        f"The object store `{S.OBJECT_STORE}` is the stream `{OBJECT_STREAM}`: objects kept"
        f" {_duration(blobs.max_age_seconds)}, {_size(blobs.max_bytes)} at most (it refuses"
        " new objects when full).",
    ]
    return "\n".join(out)


def states_diagram() -> str:
    """The session state machine as a mermaid diagram: an arrow per allowed transition
    (ERROR and CANCELLED, reachable from every live state, drawn once from "live")."""
    lines = ["```mermaid", "stateDiagram-v2", "    [*] --> REGISTERED"]
    for to, sources in ALLOWED_FROM.items():
        if sources == LIVE_STATES:
            lines.append(f"    live --> {to}")
            continue
        lines += [f"    {src} --> {to}" for src in SessionState if src in sources]
    lines += [f"    {s} --> [*]" for s in SessionState if s in TERMINAL_STATES]
    lines += ['    state "any live state" as live', "```"]
    return "\n".join(lines)


def events() -> list:
    return walk([Event], stop=[Trajectory])


def undocumented_fields() -> list[str]:
    return undocumented(events())


def render() -> str:
    parts = [
        "# NATS subjects, streams and keys",
        "",
        markdown(S.__doc__ or "").strip(),
        "",
        "## Session states",
        "",
        "Each transition is published on `polar.events.session.<state>` (a"
        " [SessionStateChanged](#sessionstatechanged)); the registry's compare-and-set"
        " script allows exactly these (`schemas/session.py`'s `ALLOWED_FROM`). ERROR and"
        " CANCELLED are entered from any live state (`live`).",
        "",
        states_diagram(),
        "",
        names_section(),
        "",
        streams_section(),
        "",
        "## Events",
        "",
        markdown(inspect.getmodule(Event).__doc__ or "").strip(),
        "",
        *(section(t, PAGE, level=3) + "\n" for t in events()),
    ]
    return "\n".join(parts)
