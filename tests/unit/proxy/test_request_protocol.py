"""The proxy's routes are typed against two request shapes (``proxy.io.serving``):
``RequestHead`` for the routes that read no body, ``CallRequest`` for model calls. Both
request classes the server layer makes offer both, and are the only requests any route of
the proxy receives (its operator's routes too: no litestar ``Request`` since issue 14)."""

from __future__ import annotations

from types import SimpleNamespace

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
    for request in (asgi, rsgi):
        assert isinstance(request, RequestHead)
    assert asgi.query_params == {"key": "abc"} and rsgi.query_params == {"key": "abc"}


def test_both_can_be_read_and_streamed():
    asgi = AsgiRequest(SCOPE, None, None)
    rsgi = RsgiRequest(SimpleNamespace(headers={}, query_string=""), None)
    assert isinstance(asgi, CallRequest) and isinstance(rsgi, CallRequest)
