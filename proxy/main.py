"""Proxy service: ``polar serve proxy``. Harnesses call it as their model API.

Admin (for trainers, per replica): ``POST /admin/pause``, ``POST /admin/resume``,
``POST /admin/update_weights {"model_path": ...}`` (pause, drain, update, resume),
``GET /admin/weight_version``.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from litestar import Litestar, Request, Response, get, post

from proxy import metrics
from proxy.app import SessionInfo
from proxy.app import create_app as create_proxy_app
from proxy.backends.factory import make_pool
from proxy.capture import SessionStore
from proxy.config import ProxyConfig
from proxy.conversation import Conversation
from proxy.gate import WeightGate
from proxy.handler import CompletionHandler
from proxy.resp import Resp
from proxy.sessions import SessionResolver
from proxy.tokenization import ChatTokenizer
from schemas import UpstreamMode
from services.common.host import ServiceHost
from services.common.http import ops_routes
from services.common.settings import load

log = logging.getLogger("polar.proxy")


class _Late:
    """Callables the app is built with before the lifespan has connected anything."""

    handler: CompletionHandler | None = None
    resolver: SessionResolver | None = None
    tokenizer: ChatTokenizer | None = None

    async def complete(self, *args):
        return await self.handler(*args)

    async def resolve(self, token: str) -> SessionInfo | None:
        return await self.resolver(token)

    async def count(self, session: SessionInfo, conv: Conversation) -> int:
        if self.tokenizer is None:
            return sum(len(str(m)) for m in conv.messages) // 4
        return len(
            self.tokenizer.render_ids(conv.to_openai_messages(), conv.to_openai_tools() or None)
        )


def admin_routes(gate: WeightGate, state: dict) -> list:
    @post("/admin/pause", status_code=200)
    async def pause() -> dict:
        metrics.PAUSED.set(1)
        return {"paused": True, "drained": await gate.pause()}

    @post("/admin/resume", status_code=200)
    async def resume() -> dict:
        gate.resume()
        metrics.PAUSED.set(0)
        return {"paused": False}

    @post("/admin/update_weights", status_code=200)
    async def update_weights(request: Request) -> Response:
        body = await request.json()
        backend = state["backend"]
        await gate.pause()
        metrics.PAUSED.set(1)
        try:
            version = await backend.update_weights_from_disk(
                body["model_path"], body.get("version")
            )
        except Exception as exc:  # noqa: BLE001 - report it; the gate reopens either way
            return Response({"ok": False, "error": str(exc)}, status_code=502)
        finally:
            gate.resume()
            metrics.PAUSED.set(0)
        return Response({"ok": True, "weight_version": version})

    @get("/admin/weight_version")
    async def weight_version() -> dict:
        return {"weight_version": await state["backend"].weight_version()}

    return [pause, resume, update_weights, weight_version]


async def probe_until_up(backend, timeout: float) -> None:
    """Probe the engine, waiting while it is still starting; a capability refusal is final."""
    import asyncio

    from proxy.backends.base import BackendCapabilityError, BackendError

    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await backend.probe()
            return
        except BackendCapabilityError:
            raise
        except BackendError as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise
            log.info("engine not up yet (%s); retrying", exc)
            await asyncio.sleep(1.0)


def create_app(config: ProxyConfig | None = None) -> Litestar:
    cfg = config or load(ProxyConfig)
    host = ServiceHost("proxy", cfg)
    gate, late, state = WeightGate(), _Late(), {}
    mode = UpstreamMode(cfg.mode)
    engine = cfg.engine()
    if cfg.tokenizer_dir():
        late.tokenizer = ChatTokenizer.load(cfg.tokenizer_dir())

    @asynccontextmanager
    async def lifespan(app: Litestar):
        await host.start()
        backend = make_pool(engine.kind, engine.urls, model=engine.model, modes=(mode,))
        if cfg.probe_backend:  # refuses an engine that cannot return token ids
            await probe_until_up(backend, cfg.probe_timeout_seconds)
        backend.start()
        state["backend"] = backend
        late.resolver = SessionResolver(host.registry, grace_seconds=cfg.grace_seconds)
        store = SessionStore(Resp.from_url(cfg.redis_url))  # its own pipelined connection
        late.handler = CompletionHandler(
            bus=host.bus,
            store=store,
            backend=backend,
            gate=gate,
            mode=mode,
            tokenizer=late.tokenizer,
            default_max_tokens=cfg.default_max_tokens,
        )
        try:
            yield
        finally:
            await backend.aclose()
            await store.redis.aclose()
            await host.stop()

    app = create_proxy_app(
        late.complete,
        late.resolve,
        count_tokens=late.count,
        max_body_bytes=cfg.max_body_bytes,
        keepalive_seconds=cfg.keepalive_seconds,
        route_handlers=[*ops_routes("proxy", host.health), *admin_routes(gate, state)],
        lifespan=[lifespan],
    )
    return app
