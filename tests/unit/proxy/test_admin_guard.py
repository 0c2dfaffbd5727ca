"""The proxy's admin routes need its admin token, and are closed without one; the
refusal is a 401 in the error body every SDK reads, decided before the body is read."""

from __future__ import annotations

from litestar.testing import TestClient

from proxy.app import create_app, unprepared
from proxy.gate import WeightGate
from proxy.io.serving import ProxyApp
from proxy.main import admin_routes
from tests.unit.protocols.app_support import Scripted, resolve

ROUTES = ("/admin/pause", "/admin/resume", "/admin/flush_cache", "/admin/pause_generation")


def admin_app(token: str | None) -> ProxyApp:
    routes = admin_routes(WeightGate(), {}, token)
    return create_app(unprepared(Scripted()), resolve, operator_routes=routes)


def refusal(r) -> str:
    assert r.status_code == 401
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("unauthorized_error", 401)
    return error["message"]


def test_a_proxy_without_an_admin_token_refuses_every_admin_call():
    """Issue 17: /admin/pause answered 200 without a credential."""
    with TestClient(admin_app(None)) as client:
        for path in ROUTES:
            r = client.post(path, headers={"authorization": "Bearer anything"})
            assert "no admin_token" in refusal(r), path
        assert "no admin_token" in refusal(client.get("/admin/weight_version"))


def test_the_admin_token_opens_them_and_nothing_else_does():
    with TestClient(admin_app("s3cret-admin")) as client:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret-admin"}):
            refusal(client.post("/admin/pause", headers=headers))
        ok = client.post("/admin/pause", headers={"authorization": "Bearer s3cret-admin"})
        assert ok.status_code == 200 and ok.json() == {"paused": True, "drained": 0}
        assert client.post(
            "/admin/resume", headers={"authorization": "Bearer s3cret-admin"}
        ).json() == {"paused": False}


def test_a_refused_weight_update_is_refused_before_its_body_is_read():
    """A harness that sends a huge body to an admin route gets its 401 at once."""
    with TestClient(admin_app("s3cret-admin")) as client:
        r = client.post("/admin/update_weights", content=b"x" * (1 << 20))
        assert "needs `Authorization: Bearer" in refusal(r)


def test_a_bad_weight_update_is_a_400_and_an_oversized_one_a_413():
    admin = {"authorization": "Bearer s3cret-admin"}
    with TestClient(admin_app("s3cret-admin")) as client:
        bad = client.post("/admin/update_weights", content=b'{"x": 1}', headers=admin)
        assert bad.status_code == 400
        assert bad.json() == {
            "ok": False,
            "error": "bad request: Object contains unknown field `x`",
        }
        huge = client.post("/admin/update_weights", content=b"x" * (1 << 20), headers=admin)
        assert huge.status_code == 413 and huge.json()["error"]["type"] == "too_large_error"
