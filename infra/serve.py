"""Run one service of ``infra.catalog`` in this process, as ``polar serve`` does."""

from __future__ import annotations

from infra.catalog import ServiceKind


def serve_service(kind: ServiceKind, host: str, port: int) -> None:
    """The proxy (``native``) on ``proxy.io.native``'s HTTP/1.1 server, which runs on its
    own event loop with no server threads; every other service under granian (ASGI)."""
    if kind.native:
        from proxy.io.native import serve_native

        serve_native(kind.target, host, port)
    else:
        from services.common.http import serve

        serve(kind.target, host, port)
