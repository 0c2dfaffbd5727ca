"""``ProtocolRoutes``: the one router of the harness-facing surface (issue 14: the
protocols' POST routes had a router of their own and their GET routes litestar's)."""

from __future__ import annotations

import pytest

from proxy.app import PROBE_PATHS, create_app, unprepared
from proxy.io.serving import ProtocolRoutes, Reply
from proxy.protocols import PROTOCOLS
from tests.unit.protocols.app_support import Scripted, resolve


async def call(spec, route, request):  # noqa: ARG001 - the routes' two kinds, told apart
    return Reply(201)


async def head(spec, route, request):  # noqa: ARG001
    return Reply(202)


WRONG, PROBED = Reply(405), Reply(200)
ROUTES = ProtocolRoutes(call, head, PROTOCOLS, WRONG, probes=PROBE_PATHS, probe_reply=PROBED)


@pytest.mark.parametrize(
    ("method", "path", "serve", "protocol", "params"),
    [
        ("POST", "/v1/chat/completions", call, "openai_chat", {}),
        ("POST", "/s/tok/v1/messages", call, "anthropic_messages", {"token": "tok"}),
        ("POST", "/v1/messages/count_tokens", call, "anthropic_messages", {}),
        ("POST", "/v1beta/models/m:generateContent", call, "gemini",
         {"target": "m:generateContent"}),
        ("GET", "/v1/models", head, "models", {}),
        ("GET", "/s/tok/v1/models/served-model", head, "models",
         {"token": "tok", "model_id": "served-model"}),
        ("GET", "/v1beta/models/m", head, "gemini", {"target": "m"}),
    ],
)  # fmt: skip
def test_every_protocol_route_is_matched_here(method, path, serve, protocol, params):
    got = ROUTES.match(method, path)
    assert not isinstance(got, Reply) and got is not None
    assert got[0] is serve and got[1].name == protocol and got[3] == params


@pytest.mark.parametrize(
    ("method", "path", "want"),
    [
        ("GET", "/v1/chat/completions", WRONG),  # a known path, another method
        ("POST", "/v1/models", WRONG),
        ("DELETE", "/s/tok/v1/responses", WRONG),
        ("HEAD", "/", PROBED),
        ("HEAD", "/s/tok/api/hello", PROBED),
        ("GET", "/", None),  # not the harnesses': litestar's (its 404)
        ("GET", "/healthz", None),
        ("POST", "/admin/pause", None),
        ("POST", "/v1/nothing-here", None),
        ("POST", "/s/v1/chat/completions", None),  # no token segment
    ],
)
def test_the_rest_is_a_405_a_probe_or_not_this_surface(method, path, want):
    assert ROUTES.match(method, path) is want


def test_no_path_is_known_to_both_routers():
    """Litestar keeps only the operator's routes (the proxy service's, as it serves):
    nothing a harness calls."""
    from proxy.config import ProxyConfig
    from proxy.main import create_app as service_app

    bare = create_app(unprepared(Scripted()), resolve)
    assert not bare.routes  # the protocols' app alone: litestar routes nothing
    app = service_app(ProxyConfig())  # built, not started: no servers needed
    paths = {r.path for r in app.routes}
    assert {"/healthz", "/metrics", "/admin/pause"} <= paths
    for path in paths:
        for method in ("GET", "POST", "HEAD"):
            assert not isinstance(app.hot.match(method, path), tuple), (method, path)
