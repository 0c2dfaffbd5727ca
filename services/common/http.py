"""The ops surface every service process serves (``/healthz`` and Prometheus ``/metrics``),
and the API docs a service with an HTTP API serves (``/schema``, offline)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from litestar import Response, Router, get
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, SwaggerRenderPlugin, YamlRenderPlugin
from litestar.openapi.spec import (
    Components,
    OpenAPIMediaType,
    OpenAPIResponse,
    Operation,
    Reference,
    RequestBody,
    SecurityScheme,
)
from litestar.static_files import create_static_files_router
from swagger_ui_bundle import swagger_ui_path

from services.common.metrics import render

HealthCheck = Callable[[], Awaitable[dict[str, object]]]


async def health_report(service: str, health: HealthCheck) -> tuple[int, dict[str, object]]:
    """``/healthz``'s status and body: 200 when every check passed, else 503."""
    checks = await health()
    ok = all(v is True or (isinstance(v, dict) and v.get("ok", True)) for v in checks.values())
    return 200 if ok else 503, {"service": service, "ok": ok, "checks": checks}


def ops_routes(service: str, health: HealthCheck) -> list[HTTPRouteHandler]:
    """The ops surface as litestar routes (the proxy, which serves no litestar app,
    declares its own from ``health_report`` and ``metrics.render``)."""

    @get("/healthz", include_in_schema=False)
    async def healthz() -> Response:
        status, body = await health_report(service, health)
        return Response(body, status_code=status)

    @get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        body, content_type = render()
        return Response(body, media_type=content_type)

    return [healthz, metrics]


def serve(target: str, host: str, port: int, *, factory: bool = True) -> None:
    """Run an ASGI app (``module:callable``) under granian, one worker (the proxy has a
    server of its own: ``proxy.io.native``; ``infra.serve`` picks). A worker that dies
    ends the server, for its supervisor to restart: granian's own respawn ends the whole
    server when a worker dies within 5.5 s of its respawn, which a second poison message
    does, while the quarantine (services/common/quarantine.py) counts deaths across
    restarts of the process."""
    from granian import Granian
    from granian.constants import Interfaces, Loops

    Granian(
        target,
        address=host,
        port=port,
        interface=Interfaces.ASGI,
        workers=1,
        factory=factory,
        loop=_fastest_loop(Loops),
        log_access=False,
    ).serve()


def _fastest_loop(loops):
    """uvloop where it is installed (10-19% more proxy requests per CPU-second, measured
    in tests/bench/bench_proxy.py), asyncio otherwise."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return loops.asyncio
    return loops.uvloop


# -- API docs: /schema (Swagger UI from the swagger-ui-bundle package, no CDN) -------------
DOCS_ASSETS = "/schema/assets"  # swagger-ui's dist, served by the app itself
BEARER = [{"bearer": []}]  # a route's ``security=``: it needs ``Authorization: Bearer``
_JSON = "application/json"


def api_docs(title: str, version: str, schemas: Mapping[str, dict]) -> tuple[OpenAPIConfig, Router]:
    """The OpenAPI config (Swagger UI at ``/schema``, the document at
    ``/schema/openapi.json`` and ``.yaml``) and the route that serves the page's assets:
    every URL the page loads is the app's own, so it works with no network. ``schemas``
    (JSON Schema by name, e.g. msgspec's ``schema_components``) join the components, for
    ``Reference("#/components/schemas/<name>")`` in an ``operation``."""
    swagger = SwaggerRenderPlugin(
        path=["/", "/swagger"],
        js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
        css_url=f"{DOCS_ASSETS}/swagger-ui.css",
        standalone_preset_js_url=f"{DOCS_ASSETS}/swagger-ui-standalone-preset.js",
        favicon=f"<link rel='icon' type='image/png' href='{DOCS_ASSETS}/favicon-32x32.png'>",
    )
    config = OpenAPIConfig(
        title=title,
        version=version,
        render_plugins=[swagger, JsonRenderPlugin(), YamlRenderPlugin()],
        components=_WithSchemas(
            security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")},
            extra_schemas=dict(schemas),
        ),
    )
    assets = create_static_files_router(DOCS_ASSETS, [swagger_ui_path], name="schema-assets")
    return config, assets


@dataclass
class _WithSchemas(Components):
    """Components with schemas of our own: litestar replaces ``schemas`` with the ones it
    generates from handler annotations, so ours are added when the document is written."""

    extra_schemas: dict[str, dict] = field(default_factory=dict)

    @property
    def _exclude_fields(self) -> set[str]:
        return {"extra_schemas"}

    def to_schema(self) -> dict:
        out = super().to_schema()
        out["schemas"] = {**out.get("schemas", {}), **self.extra_schemas}
        return out


def ref(name: str) -> Reference:
    return Reference(ref=f"#/components/schemas/{name}")


def operation(
    *, body: str | None = None, responses: Mapping[int, tuple[str, str]]
) -> type[Operation]:
    """An ``operation_class`` for a route whose handler reads its raw body and returns a
    plain ``Response`` (nothing for litestar to infer): the request body and each status's
    response (description, component name) as the document states them."""
    request_body = None
    if body is not None:
        content = {_JSON: OpenAPIMediaType(schema=ref(body))}
        request_body = RequestBody(content=content, required=True)
    documented = {
        str(status): OpenAPIResponse(
            description=why, content={_JSON: OpenAPIMediaType(schema=ref(name))}
        )
        for status, (why, name) in responses.items()
    }

    @dataclass
    class Documented(Operation):
        def __post_init__(self) -> None:
            self.request_body = request_body
            self.responses = documented

    return Documented
