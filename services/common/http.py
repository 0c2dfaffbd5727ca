"""The ops surface every service process serves: ``/healthz`` and Prometheus ``/metrics``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from litestar import Response, get
from litestar.handlers import HTTPRouteHandler

from services.common.metrics import render

HealthCheck = Callable[[], Awaitable[dict[str, object]]]


async def health_report(service: str, health: HealthCheck) -> tuple[int, dict[str, object]]:
    """``/healthz``'s status and body: 200 when every check passed, else 503."""
    checks = await health()
    ok = all(v is True or (isinstance(v, dict) and v.get("ok", True)) for v in checks.values())
    return 200 if ok else 503, {"service": service, "ok": ok, "checks": checks}


def ops_routes(service: str, health: HealthCheck) -> list[HTTPRouteHandler]:
    """The ops surface as litestar routes (the proxy, which serves no litestar app,
    declares its own from ``health_report`` and ``metrics.render``)."""

    @get("/healthz", include_in_schema=False)
    async def healthz() -> Response:
        status, body = await health_report(service, health)
        return Response(body, status_code=status)

    @get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        body, content_type = render()
        return Response(body, media_type=content_type)

    return [healthz, metrics]


def serve(target: str, host: str, port: int, *, factory: bool = True) -> None:
    """Run an ASGI app (``module:callable``) under granian, one worker (the proxy has a
    server of its own: ``proxy.io.native``; ``infra.serve`` picks)."""
    from granian import Granian
    from granian.constants import Interfaces, Loops

    Granian(
        target,
        address=host,
        port=port,
        interface=Interfaces.ASGI,
        workers=1,
        factory=factory,
        loop=_fastest_loop(Loops),
        log_access=False,
        # a worker that dies (a plugin that kills its process, the OOM killer) is started
        # again by the server's own process, as a supervisor would: the message it held
        # comes back and, dying again and again, is quarantined (services/common/quarantine.py)
        respawn_failed_workers=True,
        respawn_interval=1.0,
    ).serve()


def _fastest_loop(loops):
    """uvloop where it is installed (10-19% more proxy requests per CPU-second, measured
    in tests/bench/bench_proxy.py), asyncio otherwise."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return loops.asyncio
    return loops.uvloop
