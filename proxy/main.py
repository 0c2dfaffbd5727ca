"""Proxy service: ``polar serve proxy``. Harnesses call it as their model API.

Admin (for trainers, per replica): ``POST /admin/pause``, ``POST /admin/resume`` (the
proxy's own gate: new calls wait, in-flight ones drain), ``POST /admin/update_weights
{"model_path": ...}`` (pause, drain, update, resume), ``GET /admin/weight_version``; and
the engine's own control on every healthy worker, passed through: ``POST
/admin/pause_generation``, ``POST /admin/continue_generation``, ``POST /admin/flush_cache``
(``{"ok": true}``). An engine's refusal is ``{"ok": false, "error", "kind", "worker"}``
with 400 (it refused the request), 501 (it has no such endpoint) or 502 (it failed). Every
admin route needs ``admin_token`` as a Bearer token (401 otherwise); a proxy without one
refuses them all. Sandboxes never reach them: the bridge of a ``network: none`` sandbox
forwards only its own session's routes (``services/runtimes/bridge.py``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Awaitable
from contextlib import asynccontextmanager

import msgspec

from proxy import metrics
from proxy.app import ModelCall, SessionInfo, generic_error, json_response
from proxy.app import create_app as create_proxy_app
from proxy.backends.base import BackendCapabilityError, BackendError, Capabilities
from proxy.backends.base import ErrorKind as BackendKind
from proxy.backends.factory import engine_settings, make_pool
from proxy.backends.probe import ProbeIds, not_ready, probe_refused, prompt_ids
from proxy.capture import SessionStore
from proxy.config import ProxyConfig
from proxy.errors import ErrorKind
from proxy.gate import WeightGate
from proxy.handler import CompletionHandler
from proxy.images import ImageStore
from proxy.io.resp import Resp
from proxy.io.serving import Answer, CallRequest, OperatorRoute, ProxyApp, Reply
from proxy.io.spin import POLL
from proxy.replay import Replays
from proxy.routing import RoutingCapture, moe_shape
from proxy.sessions import SessionResolver
from schemas import UpstreamMode
from services.common import auth
from services.common.bus import CLAIM_THRESHOLD
from services.common.host import ServiceHost
from services.common.http import HealthCheck, health_report
from services.common.jspub import JetStreamPublisher
from services.common.metrics import render as render_metrics
from services.common.settings import load
from services.common.tokenization import ChatTokenizer

log = logging.getLogger("polar.proxy")
GC_YOUNG_THRESHOLD = 10_000


class _Late:
    """Callables the app is built with before the lifespan has connected anything."""

    handler: CompletionHandler | None = None
    resolver: SessionResolver | None = None
    tokenizer: ChatTokenizer | None = None

    def prepare(self, *args) -> ModelCall:
        return self.handler.prepare(*args)

    def resolve(self, token: str, for_call: bool) -> Awaitable[SessionInfo | None]:
        return self.resolver(token, for_call)  # not awaited here: the lookup starts at once

    async def unused(self, session: SessionInfo, protocol: str, reason: str) -> None:
        await self.handler.unused(session, protocol, reason)

    async def count(self, *args) -> int:
        return await self.handler.count(*args)


class WeightUpdate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_path: str
    version: str | None = None


ADMIN_BODY_BYTES = 64 * 1024  # a weight update names a path: far below this


def admin_only(token: str | None, answer: Answer) -> Answer:
    """``answer`` behind the admin token, checked before the body is read; a proxy
    without one keeps it closed (a harness reaches this port: it must not pause the
    proxy or swap the weights)."""

    async def guarded(request: CallRequest) -> Reply:
        why = auth.refusal(auth.ADMIN, request.headers, admin_token=token, service="proxy")
        if why is not None:
            return generic_error(ErrorKind.UNAUTHORIZED, why, 401)
        return await answer(request)

    return guarded


def engine_error(exc: BackendError) -> Reply:
    """An engine's failure as the admin caller's JSON error: a refusal of the request is
    the caller's 4xx, a missing endpoint 501, anything else the engine's fault (502)."""
    status = {BackendKind.BAD_REQUEST: 400, BackendKind.UNSUPPORTED: 501}.get(exc.kind, 502)
    body = {"ok": False, "error": exc.message, "kind": exc.kind.value, "worker": exc.worker}
    return json_response(status, body)


def ops_routes(service: str, health: HealthCheck) -> list[OperatorRoute]:
    """``/healthz`` and Prometheus ``/metrics`` (``services.common.http``'s, as the
    proxy's router serves them), open to anyone who reaches the port."""

    async def healthz(_request: CallRequest) -> Reply:
        return json_response(*await health_report(service, health))

    async def metrics_text(_request: CallRequest) -> Reply:
        body, content_type = render_metrics()
        return Reply(200, body, content_type)

    return [
        OperatorRoute("GET", "/healthz", healthz),
        OperatorRoute("GET", "/metrics", metrics_text),
    ]


def admin_routes(gate: WeightGate, state: dict, token: str | None) -> list[OperatorRoute]:
    """The trainer's controls (module docstring), each behind ``admin_only``."""

    async def pause(_request: CallRequest) -> Reply:
        metrics.PAUSED.set(1)
        return json_response(200, {"paused": True, "drained": await gate.pause()})

    async def resume(_request: CallRequest) -> Reply:
        gate.resume()
        metrics.PAUSED.set(0)
        return json_response(200, {"paused": False})

    async def update_weights(request: CallRequest) -> Reply:
        try:
            raw = await request.read(ADMIN_BODY_BYTES)
            body = msgspec.json.decode(raw, type=WeightUpdate)
        except msgspec.DecodeError as exc:
            return json_response(400, {"ok": False, "error": f"bad request: {exc}"})
        await gate.pause()
        metrics.PAUSED.set(1)
        try:
            version = await state["backend"].update_weights_from_disk(body.model_path, body.version)
        except BackendError as exc:
            return engine_error(exc)
        finally:
            gate.resume()
            metrics.PAUSED.set(0)
        return json_response(200, {"ok": True, "weight_version": version})

    async def weight_version(_request: CallRequest) -> Reply:
        return json_response(200, {"weight_version": await state["backend"].weight_version()})

    # The engine's control on every worker, for a trainer that runs its own sequence (the
    # proxy's gate is not touched: /admin/pause is that).
    def engine_control(op) -> Answer:
        async def control(_request: CallRequest) -> Reply:
            try:
                await op(state["backend"])
            except BackendError as exc:
                return engine_error(exc)
            return json_response(200, {"ok": True})

        return control

    routes = [
        ("POST", "/admin/pause", pause),
        ("POST", "/admin/resume", resume),
        ("POST", "/admin/update_weights", update_weights),
        ("GET", "/admin/weight_version", weight_version),
        ("POST", "/admin/pause_generation", engine_control(lambda b: b.pause())),
        ("POST", "/admin/continue_generation", engine_control(lambda b: b.resume())),
        ("POST", "/admin/flush_cache", engine_control(lambda b: b.flush_cache())),
    ]
    return [
        OperatorRoute(method, path, admin_only(token, answer)) for method, path, answer in routes
    ]


async def probe_until_up(
    backend, timeout: float, input_ids: ProbeIds | None = None
) -> Capabilities:
    """Probe the engine, waiting only while it is not up yet (no answer, 503, ...); an
    answer that refuses the probe is final at once."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await backend.probe(input_ids)
        except BackendError as exc:
            if not not_ready(exc):
                raise (
                    exc if isinstance(exc, BackendCapabilityError) else probe_refused(exc)
                ) from None
            if asyncio.get_running_loop().time() > deadline:
                raise
            log.info("engine not up yet (%s); retrying", exc)
            await asyncio.sleep(1.0)


class LazyTokenizer:
    """The served model's tokenizer, loaded when first needed: an embedded engine writes
    its model dir as it starts, so it can be read once the engine answers the probe."""

    def __init__(self, model_dir: str | None, family: str | None = None) -> None:
        self.model_dir, self.family = model_dir, family
        self._tok: ChatTokenizer | None = None

    def get(self) -> ChatTokenizer | None:
        if self._tok is None and self.model_dir:
            self._tok = ChatTokenizer.load(self.model_dir, self.family)
        return self._tok

    def probe_ids(self) -> list[int]:
        return prompt_ids(self.get())


def context_tokens(
    cfg: ProxyConfig, caps: Capabilities | None, tok: ChatTokenizer | None
) -> int | None:
    """The context a prompt must fit: configured, else the engine's, else the model's."""
    if cfg.context_tokens is not None:
        return cfg.context_tokens
    if caps is not None and caps.context_length:
        return caps.context_length
    return tok.context_tokens if tok is not None else None


def routing_capture(cfg: ProxyConfig, mode: UpstreamMode, blobs) -> RoutingCapture | None:
    """MoE routing capture as configured; a configuration that cannot capture it refuses
    the start (a trainer replaying routing must not find it missing hours later)."""
    shape = moe_shape(cfg.tokenizer_dir())
    if not cfg.routed_experts:
        if shape is not None and mode == UpstreamMode.TOKEN:
            log.info(
                "the model is a mixture of %d experts (top-%d): set routed_experts: true "
                "(and start the engine with --enable-return-routed-experts) to record its "
                "routing for R3",
                shape.experts,
                shape.top_k,
            )
        return None
    if mode != UpstreamMode.TOKEN:
        raise ValueError("routed_experts needs token mode: chat mode records no routing")
    if shape is None:
        raise ValueError(
            f"routed_experts is on, but {cfg.tokenizer_dir() or 'no model_dir'}: its "
            "config.json names no experts (num_experts / num_local_experts / "
            "n_routed_experts and num_experts_per_tok)"
        )
    log.info("recording MoE routing: %d experts, top-%d", shape.experts, shape.top_k)
    return RoutingCapture(shape, blobs)


def create_app(config: ProxyConfig | None = None) -> ProxyApp:
    cfg = config or load(ProxyConfig)
    host = ServiceHost("proxy", cfg)
    gate, late, state = WeightGate(), _Late(), {}
    metrics.INFLIGHT.set_function(lambda: gate.inflight)
    mode = UpstreamMode(cfg.mode)
    engine = cfg.engine()
    engine_settings(engine.kind, engine.settings)  # a bad or unknown setting refuses the start

    @asynccontextmanager
    async def lifespan(_app: ProxyApp):
        POLL.budget = cfg.busy_poll_microseconds / 1e6
        await host.start()
        backend = make_pool(
            engine.kind, engine.urls, model=engine.model, modes=(mode,), settings=engine.settings
        )
        tokenizer = LazyTokenizer(cfg.tokenizer_dir(), cfg.model_family)
        caps: Capabilities | None = None
        if cfg.probe_backend:  # refuses an engine that cannot return token ids
            ids = (
                tokenizer.probe_ids if mode == UpstreamMode.TOKEN and tokenizer.model_dir else None
            )
            caps = await probe_until_up(backend, cfg.probe_timeout_seconds, ids)
        late.tokenizer = tokenizer.get()  # after the probe: an embedded engine writes its dir
        routing = routing_capture(cfg, mode, host.bus.blobs)
        backend.start()
        state["backend"] = backend
        store = SessionStore(Resp.from_url(cfg.redis_url))  # its own pipelined connection
        # Records go through a lean connection of their own (nats-py for claim-checks)
        publisher = JetStreamPublisher(
            cfg.nats_url,
            name="polar-proxy-capture",
            fallback=host.bus.publish,
            fallback_above=CLAIM_THRESHOLD,
            watch=POLL.watch,
        )
        late.resolver = SessionResolver(store)
        late.handler = CompletionHandler(
            publisher=publisher,
            store=store,
            backend=backend,
            gate=gate,
            mode=mode,
            tokenizer=late.tokenizer,
            default_max_tokens=cfg.default_max_tokens,
            images=ImageStore(host.bus.blobs),
            history=cfg.history,
            context_tokens=context_tokens(cfg, caps, late.tokenizer),
            routing=routing,
            replays=Replays(host.bus),
        )
        if late.handler.bound is not None:
            log.info(late.handler.bound.describe())
        # What start-up made (modules, tokenizer, template) lives as long as the process:
        # out of the collector's sight, a full collection scans only what came later
        # (~1 ms instead of ~100 ms here, and every call in flight waits for it).
        gc.collect()
        gc.freeze()
        # A young collection every 700 net allocations ran ~0.1 times a call at 64 calls
        # in flight, each scanning every call's live objects, and pushed them on to the
        # older generations (full collections too): ~16 µs of collector a call, ~9% of
        # the proxy's CPU. Every 10,000, what a call made is mostly freed before the
        # next one: 1.7 µs a call (docs/benchmarks/history.md, issue 18).
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        try:
            yield
        finally:
            await backend.aclose()
            await store.redis.aclose()
            await publisher.aclose()
            await host.stop()

    app = create_proxy_app(
        late.prepare,
        late.resolve,
        count_tokens=late.count,
        unused_call=late.unused,
        max_body_bytes=cfg.max_body_bytes,
        keepalive_seconds=cfg.keepalive_seconds,
        operator_routes=[
            *ops_routes("proxy", host.health),
            *admin_routes(gate, state, cfg.admin_token),
        ],
        lifespan=[lifespan],
    )
    app.http_limits = cfg.http_server  # the native server's bounds (proxy/io/limits.py)
    return app
