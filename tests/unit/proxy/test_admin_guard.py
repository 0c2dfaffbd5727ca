"""The proxy's admin routes need its admin token, and are closed without one."""

from __future__ import annotations

from litestar import Litestar, Router
from litestar.testing import TestClient

from proxy.gate import WeightGate
from proxy.main import admin_guard, admin_routes

ROUTES = ("/admin/pause", "/admin/resume", "/admin/flush_cache", "/admin/pause_generation")


def admin_app(token: str | None) -> Litestar:
    routes = admin_routes(WeightGate(), {})
    return Litestar([Router("/", route_handlers=routes, guards=[admin_guard(token)])])


def test_a_proxy_without_an_admin_token_refuses_every_admin_call():
    """Issue 17: /admin/pause answered 200 without a credential."""
    with TestClient(admin_app(None)) as client:
        for path in ROUTES:
            r = client.post(path, headers={"authorization": "Bearer anything"})
            assert r.status_code == 401 and "no admin_token" in r.json()["detail"], path
        assert client.get("/admin/weight_version").status_code == 401


def test_the_admin_token_opens_them_and_nothing_else_does():
    with TestClient(admin_app("s3cret-admin")) as client:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret-admin"}):
            assert client.post("/admin/pause", headers=headers).status_code == 401
        ok = client.post("/admin/pause", headers={"authorization": "Bearer s3cret-admin"})
        assert ok.status_code == 200 and ok.json()["paused"] is True
