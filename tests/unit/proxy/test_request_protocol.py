"""The proxy's routes are typed against two request shapes (``proxy.io.serving``):
``RequestHead`` for the routes that read no body, ``CallRequest`` for model calls. Both
request classes the server layer makes offer both, and are the only requests any route of
the proxy receives (its operator's routes too: no litestar ``Request`` since issue 14)."""

from __future__ import annotations

from types import SimpleNamespace

from proxy.io.native import NativeRequest
from proxy.io.serving import AsgiRequest, CallRequest, RequestHead

CONN = SimpleNamespace(loop=None)  # what a request takes of its connection when made

SCOPE = {
    "type": "http",
    "method": "GET",
    "path": "/v1/models",
    "query_string": b"key=abc",
    "headers": [(b"authorization", b"Bearer t")],
}


async def test_every_request_a_route_gets_has_the_head():
    asgi = AsgiRequest(SCOPE, None, None)
    native = NativeRequest(CONN, "GET", b"/v1/models?key=abc", {"x-api-key": "t"}, False)
    for request in (asgi, native):
        assert isinstance(request, RequestHead)
    assert asgi.query_params == {"key": "abc"} and native.query_params == {"key": "abc"}
    assert native.path == "/v1/models" and native.headers == {"x-api-key": "t"}


async def test_both_can_be_read_and_streamed():  # made in the server's loop
    asgi = AsgiRequest(SCOPE, None, None)
    native = NativeRequest(CONN, "POST", b"/v1/chat/completions", {}, False)
    assert isinstance(asgi, CallRequest) and isinstance(native, CallRequest)
