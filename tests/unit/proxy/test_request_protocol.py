"""The proxy's routes are typed against two request shapes (``proxy.io.serving``):
``RequestHead`` for the routes that read no body, ``CallRequest`` for model calls. Both
request classes the server layer makes offer both. (Litestar's ``Request`` offers the
head too, though since ``ProtocolRoutes`` no protocol route receives one.)"""

from __future__ import annotations

from types import SimpleNamespace

from litestar import Request

from proxy.io.serving import AsgiRequest, CallRequest, RequestHead, RsgiRequest

SCOPE = {
    "type": "http",
    "method": "GET",
    "path": "/v1/models",
    "query_string": b"key=abc",
    "headers": [(b"authorization", b"Bearer t")],
}


def test_every_request_a_route_gets_has_the_head():
    asgi = AsgiRequest(SCOPE, None, None)
    rsgi = RsgiRequest(SimpleNamespace(headers={"x-api-key": "t"}, query_string="key=abc"), None)
    litestar = Request({**SCOPE, "app": None, "path_params": {}, "state": {}})
    for request in (asgi, rsgi, litestar):
        assert isinstance(request, RequestHead)
    assert asgi.query_params == {"key": "abc"} and rsgi.query_params == {"key": "abc"}
    assert litestar.query_params.get("key") == "abc"


def test_only_the_server_layers_requests_can_be_read_and_streamed():
    asgi = AsgiRequest(SCOPE, None, None)
    rsgi = RsgiRequest(SimpleNamespace(headers={}, query_string=""), None)
    assert isinstance(asgi, CallRequest) and isinstance(rsgi, CallRequest)
    litestar = Request({**SCOPE, "app": None, "path_params": {}, "state": {}})
    assert not isinstance(litestar, CallRequest)  # no model call could be served from it
