"""docs/reference/http-api.md and docs/reference/openapi.json: the scheduler's HTTP API,
from the OpenAPI document litestar writes for the app (``services/scheduler/main.py``, its
shapes in ``services/scheduler/api.py``) — the same one the running scheduler serves at
``/schema/openapi.json`` — with each answer's fields from their structs' comments."""

from __future__ import annotations

import json

import services.scheduler.api as api
from infra.docgen import task, trajectory
from infra.docgen.source import cell, markdown
from infra.docgen.structs import Page, section, undocumented, walk
from schemas.session import Session
from services.scheduler.config import SchedulerConfig
from services.scheduler.main import create_app

JSON_PAGE = "openapi.json"
METHODS = ("get", "post", "put", "patch", "delete")
ANSWERS = (api.Accepted, api.Error, api.TaskView, api.Cancelled, Session)
# The document's name for a struct where it is not the class's (api.SESSION_VIEW).
RENAMED = {api.SESSION_VIEW: Session}


def document() -> dict:
    """The OpenAPI document, as the app serves it (built without its lifespan)."""
    return create_app(SchedulerConfig()).openapi_schema.to_schema()


def json_text() -> str:
    return json.dumps(document(), indent=2, ensure_ascii=False)


def _elsewhere() -> dict[type, str]:
    out = {t.cls: "task.md" for t in task.structs()}
    out.update({t.cls: "trajectory.md" for t in trajectory.structs()})
    return out


PAGE = Page(elsewhere=_elsewhere())


def answers():
    """The answers' structs documented here (the task's and the result's link away)."""
    return walk(ANSWERS, stop=PAGE.elsewhere)


def _schema_link(schema: dict) -> str:
    name = schema.get("$ref", "").rsplit("/", 1)[-1]
    if not name:
        return schema.get("type", "")
    cls = RENAMED.get(name) or next((t.cls for t in answers() if t.cls.__name__ == name), None)
    if cls is None:
        cls = next(c for c in PAGE.elsewhere if c.__name__ == name)
    return f"[{name}]({PAGE.link(cls)})"


def _param_text(p: dict) -> str:
    text = p.get("description", "")
    if not text and p["name"].endswith("_id"):
        text = f"the {p['name'][:-3]}'s id"
    return text


def operation_section(path: str, method: str, op: dict) -> str:
    out = [f"### `{method.upper()} {path}`", "", markdown(op.get("summary", "")), ""]
    if op.get("description"):
        out += [markdown(op["description"]), ""]
    if op.get("security"):
        out += ["Needs `Authorization: Bearer TOKEN`.", ""]
    if params := op.get("parameters"):
        out += ["| parameter | in | type | description |", "|---|---|---|---|"]
        for p in params:
            row = (f"`{p['name']}`", p["in"], p["schema"].get("type", ""), _param_text(p))
            out.append("| " + " | ".join(cell(x) for x in row) + " |")
        out.append("")
    if body := op.get("requestBody"):
        schema = body["content"]["application/json"]["schema"]
        out += [f"Body: {_schema_link(schema)} (JSON).", ""]
    out += ["| status | answer | when |", "|---|---|---|"]
    for status, r in op["responses"].items():
        schema = r.get("content", {}).get("application/json", {}).get("schema", {})
        out.append(f"| {status} | {_schema_link(schema)} | {cell(markdown(r['description']))} |")
    return "\n".join(out)


def operations(doc: dict) -> list[tuple[str, str, dict]]:
    return [(p, m, ops[m]) for p, ops in doc["paths"].items() for m in METHODS if m in ops]


def undocumented_parts() -> list[str]:
    """Operations without a summary, answers without a description, fields without one."""
    missing = []
    for path, method, op in operations(document()):
        if not op.get("summary"):
            missing.append(f"{method.upper()} {path}")
        missing += [
            f"{method.upper()} {path} {s}"
            for s, r in op["responses"].items()
            if not r.get("description")
        ]
    return missing + undocumented(answers())


def render() -> str:
    doc = document()
    parts = [
        "# Scheduler HTTP API",
        "",
        markdown(api.__doc__ or "").strip(),
        "",
        f"The whole OpenAPI {doc['openapi']} document: [{JSON_PAGE}]({JSON_PAGE}) (a running"
        " scheduler serves it at `/schema/openapi.json`, and Swagger UI at `/schema`). The"
        " admin token submits and cancels, the read token (or the admin one) reads; see"
        " [SchedulerConfig](topology.md#schedulerconfig).",
        "",
        "## Routes",
        "",
        *(operation_section(*x) + "\n" for x in operations(doc)),
        "## Answers",
        "",
        f"`{api.SESSION_VIEW}` is a [Session](#session) without its `token`.",
        "",
        *(section(t, PAGE, level=3) + "\n" for t in answers()),
    ]
    return "\n".join(parts)
