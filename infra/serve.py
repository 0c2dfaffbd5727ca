"""Run one service of ``infra.catalog`` in this process, as ``polar serve`` does."""

from __future__ import annotations


def serve_app(target: str, host: str, port: int, *, native: bool) -> None:
    """``target`` (a catalog row's ``module:create_app``): one the catalog marks
    ``native`` (the proxy) on ``proxy.io.native``'s HTTP/1.1 server, which runs on its
    own event loop with no server threads; every other service under granian (ASGI)."""
    if native:
        from proxy.io.native import serve_native

        serve_native(target, host, port)
    else:
        from services.common.http import serve

        serve(target, host, port)
