"""``ProxyRoutes``: the one router of the proxy's whole HTTP surface (issue 14: two
routers served it, the protocols' POST routes their own and litestar the rest, bridged
over RSGI)."""

from __future__ import annotations

import pytest

from proxy.app import PROBE_PATHS
from proxy.io.serving import OperatorRoute, ProxyRoutes, Reply, Served
from proxy.protocols import PROTOCOLS


async def call(spec, route, request):  # noqa: ARG001 - the routes' three kinds, told apart
    return Reply(201)


async def head(spec, route, request):  # noqa: ARG001
    return Reply(202)


async def operator(spec, route, request):  # noqa: ARG001
    return Reply(203)


async def answer(request):  # noqa: ARG001
    return Reply(200)


WRONG, MISSING, PROBED = Reply(405), Reply(404), Reply(200)
SERVED = Served(
    call,
    head,
    operator,
    wrong_method=WRONG,
    not_found=MISSING,
    probe=PROBED,
    refused=lambda status, reason: Reply(status, reason.encode()),
)
OPERATOR = [
    OperatorRoute("GET", "/healthz", answer),
    OperatorRoute("GET", "/metrics", answer),
    OperatorRoute("POST", "/admin/pause", answer),
]
ROUTES = ProxyRoutes(SERVED, PROTOCOLS, OPERATOR, probes=PROBE_PATHS)


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
    assert not isinstance(got, Reply)
    assert got[0] is serve and got[1].name == protocol and got[3] == params


@pytest.mark.parametrize(
    ("method", "path", "index"),
    [("GET", "/healthz", 0), ("GET", "/metrics/", 1), ("POST", "/admin/pause", 2)],
)
def test_the_operators_routes_are_matched_here_too(method, path, index):
    got = ROUTES.match(method, path)
    assert not isinstance(got, Reply)
    assert got[0] is operator and got[1] is None and got[2] is OPERATOR[index]


@pytest.mark.parametrize(
    ("method", "path", "want"),
    [
        ("GET", "/v1/chat/completions", WRONG),  # a known path, another method
        ("POST", "/v1/models", WRONG),
        ("DELETE", "/s/tok/v1/responses", WRONG),
        ("POST", "/healthz", WRONG),
        ("GET", "/admin/pause", WRONG),
        ("OPTIONS", "/metrics", WRONG),
        ("HEAD", "/", PROBED),
        ("HEAD", "/s/tok/api/hello", PROBED),
        ("GET", "/", MISSING),
        ("POST", "/s/tok/admin/pause", MISSING),  # the operator's routes are not a session's
        ("GET", "/s/tok/healthz", MISSING),
        ("POST", "/v1/nothing-here", MISSING),
        ("POST", "/v1/chat/completions/", MISSING),
        ("POST", "/s/v1/chat/completions", MISSING),  # no token segment
    ],
)
def test_the_rest_is_a_405_a_probe_or_a_404(method, path, want):
    assert ROUTES.match(method, path) is want


@pytest.mark.parametrize(
    "clash",
    [OperatorRoute("GET", "/v1/models", answer), OperatorRoute("GET", "/healthz", answer)],
)
def test_a_path_is_routed_once(clash):
    with pytest.raises(ValueError, match="already routed"):
        ProxyRoutes(SERVED, PROTOCOLS, [*OPERATOR, clash])


def test_the_proxy_service_serves_its_operator_routes_with_the_same_router():
    from proxy.config import ProxyConfig
    from proxy.main import create_app as service_app

    app = service_app(ProxyConfig())  # built, not started: no servers needed
    paths = {path for _, path in app.routes.operator}
    assert {"/healthz", "/metrics", "/admin/pause", "/admin/weight_version"} <= paths
    for method, path in app.routes.operator:
        got = app.routes.match(method, path)
        assert not isinstance(got, Reply) and got[0] == app.routes.served.operator
