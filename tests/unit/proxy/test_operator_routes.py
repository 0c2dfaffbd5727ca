"""The operator's routes as the proxy's own router serves them (no litestar app):
``/healthz``'s verdict, ``/metrics`` in Prometheus text, a failing route's 500, and
unknown paths and wrong methods, all in the shapes litestar answered them before."""

from __future__ import annotations

from litestar.testing import TestClient

from proxy.app import create_app, unprepared
from proxy.io.serving import OperatorRoute
from proxy.main import ops_routes
from tests.unit.protocols.app_support import Scripted, resolve

CHECKS: dict[str, object] = {}


async def health() -> dict[str, object]:
    return dict(CHECKS)


async def broken(_request):
    raise RuntimeError("a bug in an operator route")


def client() -> TestClient:
    routes = [*ops_routes("proxy", health), OperatorRoute("POST", "/admin/broken", broken)]
    return TestClient(create_app(unprepared(Scripted()), resolve, operator_routes=routes))


def test_healthz_is_200_when_every_check_passes_else_503():
    with client() as c:
        CHECKS.update(nats=True, workers=True)
        ok = c.get("/healthz")
        assert (ok.status_code, ok.json()) == (
            200,
            {"service": "proxy", "ok": True, "checks": {"nats": True, "workers": True}},
        )
        CHECKS["nats"] = False
        down = c.get("/healthz/")  # a trailing slash is the same route
        assert (down.status_code, down.json()["ok"]) == (503, False)


def test_metrics_are_prometheus_text():
    with client() as c:
        r = c.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=")
    assert "# TYPE polar_proxy_" in r.text


def test_a_failing_route_unknown_paths_and_wrong_methods_get_the_generic_error_body():
    with client() as c:
        for method, path, status, kind in (
            ("POST", "/admin/broken", 500, "internal_error"),
            ("GET", "/nothing", 404, "not_found_error"),
            ("POST", "/healthz", 405, "bad_request_error"),
            ("GET", "/s/tok/healthz", 404, "not_found_error"),
        ):
            r = c.request(method, path)
            error = r.json()["error"]
            assert (r.status_code, error["type"], error["code"]) == (status, kind, status), path
