"""The scheduler's OpenAPI document is typed and its docs page works offline (issue 38, 8).

No servers: the app is built but its lifespan (NATS, Redis) never runs; the document and
the docs routes need neither.
"""

from html.parser import HTMLParser

import jsonschema
import pytest
from litestar.testing import TestClient

from services.scheduler.config import SchedulerConfig
from services.scheduler.main import create_app


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(SchedulerConfig()))  # no `with`: no lifespan


@pytest.fixture(scope="module")
def doc(client):
    got = client.get("/schema/openapi.json")
    assert got.status_code == 200
    return got.json()


def schema_of(doc: dict, media: dict) -> dict:
    """A media type's schema, as a validator resolves it against the whole document."""
    return {**media["application/json"]["schema"], "components": doc["components"]}


def test_submit_documents_the_task_request_body(doc):
    body = doc["paths"]["/tasks"]["post"]["requestBody"]
    assert body["required"] is True
    schema = schema_of(doc, body["content"])
    task = doc["components"]["schemas"]["TaskRequest"]
    assert {"instruction", "num_samples", "agent", "runtime"} <= set(task["properties"])
    assert task["required"] == ["instruction"]
    ok = {"instruction": "fix it", "num_samples": 4, "agent": {"command": "./agent.sh"}}
    jsonschema.Draft202012Validator(schema).validate(ok)
    for bad in ({"num_samples": 4}, {"instruction": "x", "num_samples": 0}):
        assert not jsonschema.Draft202012Validator(schema).is_valid(bad)


ROUTES = {
    ("/tasks", "post"): {"201": "Accepted", "400": "Error", "401": "Error", "409": "Error",
                         "413": "Error"},
    ("/tasks/{task_id}", "get"): {"200": "TaskView", "401": "Error", "404": "Error"},
    ("/tasks/{task_id}", "delete"): {"200": "Cancelled", "401": "Error", "404": "Error"},
    ("/sessions/{session_id}", "get"): {"200": "SessionView", "401": "Error", "404": "Error"},
}  # fmt: skip


@pytest.mark.parametrize(("path", "method"), list(ROUTES))
def test_every_route_has_typed_responses_and_names_its_token(doc, path, method):
    op = doc["paths"][path][method]
    got = {
        s: r["content"]["application/json"]["schema"]["$ref"] for s, r in op["responses"].items()
    }
    assert got == {s: f"#/components/schemas/{n}" for s, n in ROUTES[path, method].items()}
    assert op["security"] == [{"bearer": []}]
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_the_response_schemas_say_what_the_handlers_answer(doc):
    schemas = doc["components"]["schemas"]
    assert set(schemas["Accepted"]["properties"]) == {"task_id", "session_ids"}
    assert set(schemas["Cancelled"]["properties"]) == {"task_id", "cancelled_sessions"}
    error = {"$ref": "#/components/schemas/Error", "components": doc["components"]}
    jsonschema.Draft202012Validator(error).validate({"error": {"message": "m", "field": None}})
    assert set(schemas["ErrorBody"]["properties"]) == {"message", "field"}
    view = schemas["TaskView"]["properties"]
    assert view["spec"] == {"$ref": "#/components/schemas/TaskRequest"}
    assert {"task_id", "status", "counts", "sessions", "result"} <= set(view)
    session = schemas["SessionView"]
    assert "token" not in session["properties"] and "state" in session["properties"]


class _Urls(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]


@pytest.mark.parametrize("page", ["/schema", "/schema/swagger"])
def test_the_docs_page_loads_only_what_the_app_serves(client, page):
    got = client.get(page)
    assert got.status_code == 200 and "SwaggerUIBundle" in got.text
    parser = _Urls()
    parser.feed(got.text)
    assert len(parser.urls) >= 4  # the favicon, the stylesheet, the bundle, the preset
    for url in parser.urls:
        assert url.startswith("/") and not url.startswith("//"), url  # no CDN
        assert client.get(url).status_code == 200, url
    assert "cdn." not in got.text and "https://" not in got.text.split("<body>")[0]
