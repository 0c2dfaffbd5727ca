"""The litestar app: SGLang's HTTP surface over the embedded engine (thin I/O shell).

Routes: /generate, /v1/chat/completions, /v1/models, /model_info (/get_model_info),
/server_info (/get_server_info), /get_weight_version, /health, /health_generate,
/update_weights_from_disk, /pause_generation, /continue_generation, /flush_cache,
/abort_request, /metrics (SGLang's queue gauges, read by the runtime pool's backpressure).

With ``api_key`` set (``polar up`` always sets one), every route but the liveness and
metrics pages needs ``Authorization: Bearer <api_key>``, as SGLang's ``--api-key`` does:
a 401 in the engine's error shape, decided before the body is read.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post, route
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.handlers.base import BaseRouteHandler

from services.common import auth
from services.common.logs import service_logging
from services.common.metrics import render as render_metrics
from services.common.tokenization import TemplateRenderError
from services.common.tokenization.images import ImageInputError, image_urls
from services.engine import protocol
from services.engine.config import ServeConfig, config_from_env
from services.engine.engine import PAUSE_MODES, EngineStopped, QueueFull, RequestRejected
from services.engine.modelconfig import ModelLoadError
from services.engine.sequence import GenerationRequest
from services.engine.server import ServerState
from services.engine.vision import RequestImages, read_images
from services.engine.weights import load_model

log = logging.getLogger(__name__)
VERSION = "polar-embedded-0.1"


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        msgspec.json.encode(body),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def _body(request: Request, kind: type) -> Any:
    raw = await request.body()
    return protocol.decode_body(raw or b"{}", kind)


@route("/generate", http_method=["POST", "PUT"])
async def generate(request: Request) -> Response:
    state = _state(request)
    body: protocol.GenerateBody = await _body(request, protocol.GenerateBody)
    if body.stream:
        raise protocol.ProtocolError("stream=true is not supported by the embedded server")
    prompts, batch = protocol.generate_prompts(body, state.tokenizer)
    params = protocol.sampling_params(body.sampling_params, state.config.default_max_tokens)
    rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
    if len(rids) != len(prompts):
        raise protocol.ProtocolError("rid must have one entry per prompt")
    sources = [body.image_data] if isinstance(body.image_data, str) else body.image_data or []
    if sources and batch:
        raise protocol.ProtocolError("image_data is for one prompt, not a batch")
    if body.return_routed_experts and state.engine.model.config.moe is None:
        raise protocol.ProtocolError(
            f"model {state.served_model_name} is not a mixture of experts: "
            "return_routed_experts needs an MoE model"
        )
    images = [await _images(state, ids, sources) for ids in prompts]
    requests = [
        GenerationRequest(
            rid=rid or uuid.uuid4().hex,
            prompt_ids=ids,
            params=params,
            forced_ids=state.forced_for(None, ids),
            images=im,
            return_routed_experts=body.return_routed_experts,
        )
        for ids, rid, im in zip(prompts, rids, images, strict=True)
    ]
    results = await _run_while_connected(state, request, requests)
    out = [protocol.generate_response(r, body, state.tokenizer) for r in results]
    return _json(out if batch else out[0])


class _ClientGone(Exception):
    pass


class Unauthorized(Exception):
    pass


# Open without the key: liveness (the stack's /healthz, SGLang's /health) and the
# queue gauges the pools' backpressure reads. Nothing here generates or changes state.
OPEN_PATHS = frozenset({"/healthz", "/health", "/metrics"})


def key_guard(api_key: str):
    """A guard (it runs before the handler reads the body) refusing a request without
    ``Authorization: Bearer <api_key>``."""

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if connection.scope["path"] in OPEN_PATHS:
            return
        given = auth.bearer(connection.headers)
        if given is None:
            raise Unauthorized("this engine needs `Authorization: Bearer <api key>`")
        if not auth.matches(given, (api_key,)):
            raise Unauthorized("the bearer token is not this engine's api key")

    return guard


async def _run_while_connected(
    state: ServerState, request: Request, requests: list[GenerationRequest]
) -> list:
    """Run the requests; a client that disconnects first aborts them (as SGLang does)."""
    run = asyncio.ensure_future(state.run(requests))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not run.done():
            run.cancel()  # ServerState.run aborts its engine requests
            await asyncio.wait({run})
    if run.cancelled():
        raise _ClientGone
    return run.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _images(state: ServerState, ids: list[int], sources: list[str]) -> RequestImages | None:
    """The prompt's images, decoded off the event loop (the encoder runs in the engine,
    with the weights that compute the prompt)."""
    if not sources and (state.tokenizer.images is None or state.tokenizer.images.pad_id not in ids):
        return None
    vision = state.engine.model.config.vision
    return await asyncio.to_thread(read_images, ids, sources, state.tokenizer.images, vision)


def _chat_prompt(state: ServerState, body: protocol.ChatBody) -> list[int]:
    if body.input_ids is not None:
        return list(body.input_ids)
    if not body.messages:
        raise protocol.ProtocolError("messages must not be empty")
    kwargs = body.chat_template_kwargs or {}
    return state.tokenizer.render_ids(body.messages, body.tools, True, **kwargs)


@post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = _state(request)
    body: protocol.ChatBody = await _body(request, protocol.ChatBody)
    if body.stream:
        raise protocol.ProtocolError("stream=true is not supported by the embedded server")
    if not 1 <= body.n <= 16:
        raise protocol.ProtocolError("n must be between 1 and 16")
    prompt_ids = await asyncio.to_thread(_chat_prompt, state, body)
    forced = state.forced_for(body.messages if body.input_ids is None else None, prompt_ids)
    images = await _images(state, prompt_ids, image_urls(body.messages))
    base = body.rid or uuid.uuid4().hex
    requests = [
        GenerationRequest(
            rid=base if body.n == 1 else f"{base}-{i}",
            prompt_ids=prompt_ids,
            params=protocol.chat_sampling_params(
                body, state.config.default_max_tokens, seed_offset=i
            ),
            forced_ids=forced,
            images=images,
        )
        for i in range(body.n)
    ]
    results = await _run_while_connected(state, request, requests)
    return _json(protocol.chat_response(results, body, state.tokenizer))


@get("/v1/models")
async def models(request: Request) -> Response:
    state = _state(request)
    card = {
        "id": state.served_model_name,
        "object": "model",
        "owned_by": "polar",
        "root": state.model_path,
        "max_model_len": state.engine.context_limit,
    }
    return _json({"object": "list", "data": [card]})


@get(["/model_info", "/get_model_info"])
async def model_info(request: Request) -> Response:
    """SGLang's fields; an MoE model adds its routing shape (``moe_layers``,
    ``num_experts``, ``top_k``): what sizes ``meta_info.routed_experts``."""
    state = _state(request)
    moe = state.engine.model.config.moe
    return _json(
        {
            "model_path": state.model_path,
            "tokenizer_path": state.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.engine.version,
            "model_type": state.model_info.get("model_type"),
            "architectures": state.model_info.get("architectures"),
            "served_model_name": state.served_model_name,
            "max_context_length": state.engine.context_limit,
            **(moe.shape if moe is not None else {}),
        }
    )


@get(["/server_info", "/get_server_info"])
async def server_info(request: Request) -> Response:
    state = _state(request)
    info = msgspec.to_builtins(state.config)
    info.pop("api_key", None)  # the credential itself is never served
    info.update(
        {
            "model_path": state.model_path,
            "version": VERSION,
            "weight_version": state.engine.version,
            "scripted_policy": state.config.policy,
            "max_total_num_tokens": state.engine.context_limit,
            "internal_states": [state.engine.stats()],
        }
    )
    return _json(info)


@get("/metrics")
async def metrics(request: Request) -> Response:
    """SGLang's names, so one reader serves both (``services/pool/backpressure.py``)."""
    state = _state(request)
    stats, label = state.engine.stats(), f'{{model_name="{state.served_model_name}"}}'
    lines = []
    for name, value in (
        ("num_queue_reqs", stats["waiting"]),
        ("num_running_reqs", stats["running"]),
    ):
        lines += [f"# TYPE sglang:{name} gauge", f"sglang:{name}{label} {value}"]
    # and the process's own registry, as every Polar service serves it (the dev stack's
    # `model` service has no other /metrics)
    process, content_type = render_metrics()
    body = ("\n".join(lines) + "\n").encode() + process
    return Response(body, media_type=content_type)


@get("/get_weight_version")
async def weight_version(request: Request) -> Response:
    return _json({"weight_version": _state(request).engine.version})


@get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    if not state.engine.alive:
        return _json(protocol.error_body("engine is not running", 503, "ServiceUnavailable"), 503)
    return _json({"status": "ok", "weight_version": state.engine.version})


@get("/health_generate")
async def health_generate(request: Request) -> Response:
    state = _state(request)
    probe = GenerationRequest(
        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        prompt_ids=[state.tokenizer.eos_token_ids[0] if state.tokenizer.eos_token_ids else 0],
        params=protocol.sampling_params({"max_new_tokens": 1, "temperature": 0}, 1),
    )
    await asyncio.wait_for(state.run([probe]), timeout=20)
    return _json({"status": "ok"})


class _WeightUpdate(msgspec.Struct, kw_only=True):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


def _compatible(old, new) -> str | None:
    fields = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    )
    for name in fields:
        if getattr(old, name) != getattr(new, name):
            return f"{name} differs ({getattr(old, name)} -> {getattr(new, name)})"
    if old.moe != new.moe:  # the routing rows' shape (and the forward) would change
        return f"the mixture of experts differs ({old.moe} -> {new.moe})"
    return None


@post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Response:
    state = _state(request)
    body: _WeightUpdate = await _body(request, _WeightUpdate)
    try:
        model = await asyncio.to_thread(load_model, body.model_path)
    except ModelLoadError as exc:
        return _json({"success": False, "message": str(exc), "num_paused_requests": 0}, 400)
    problem = _compatible(state.engine.model.config, model.config)
    if problem:
        message = f"checkpoint does not match the served model: {problem}"
        return _json({"success": False, "message": message, "num_paused_requests": 0}, 400)
    future = state.engine.swap_weights(model, body.weight_version, body.abort_all_requests)
    version, carried = await asyncio.wrap_future(future)
    state.model_path = body.model_path
    message = f"Succeeded to update model weights. Weight version is now {version}."
    return _json({"success": True, "message": message, "num_paused_requests": carried})


class _Pause(msgspec.Struct, kw_only=True):
    mode: str = "abort"


@post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    body: _Pause = await _body(request, _Pause)
    if body.mode not in PAUSE_MODES:
        raise protocol.ProtocolError(f"mode must be one of {PAUSE_MODES}")
    await asyncio.wrap_future(_state(request).engine.pause(body.mode))
    return _json({"message": "Generation paused successfully.", "status": "ok"})


@post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    await asyncio.wrap_future(_state(request).engine.resume())
    return _json({"message": "Generation continued successfully.", "status": "ok"})


@route("/flush_cache", http_method=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    flushed = await asyncio.wrap_future(_state(request).engine.flush_cache())
    text = "Cache flushed.\n" if flushed else "Cache not flushed: requests are queued or running.\n"
    return Response(text, status_code=200 if flushed else 400, media_type="text/plain")


class _Abort(msgspec.Struct, kw_only=True):
    rid: str | None = None
    abort_all: bool = False


@post("/abort_request")
async def abort_request(request: Request) -> Response:
    body: _Abort = await _body(request, _Abort)
    if body.rid is None and not body.abort_all:
        raise protocol.ProtocolError("give rid or abort_all=true")
    count = await asyncio.wrap_future(
        _state(request).engine.abort(None if body.abort_all else body.rid)
    )
    return _json({"aborted": count})


def _error_handler(status: int, kind: str):
    def handle(_: Request, exc: Exception) -> Response:
        headers = {503: {"Retry-After": "1"}, 401: {"WWW-Authenticate": "Bearer"}}.get(status)
        return _json(protocol.error_body(str(exc), status, kind), status, headers)

    return handle


def _http_error(_: Request, exc: HTTPException) -> Response:
    return _json(
        protocol.error_body(str(exc.detail), exc.status_code, "HTTPError"), exc.status_code
    )


def _internal_error(_: Request, exc: Exception) -> Response:
    log.exception("request failed", exc_info=exc)
    return _json(protocol.error_body(f"internal error: {exc!r}", 500, "InternalServerError"), 500)


EXCEPTION_HANDLERS = {
    _ClientGone: lambda _, __: Response(b"", status_code=499),
    Unauthorized: _error_handler(401, "Unauthorized"),
    protocol.ProtocolError: _error_handler(400, "BadRequest"),
    RequestRejected: _error_handler(400, "BadRequest"),
    TemplateRenderError: _error_handler(400, "BadRequest"),
    ImageInputError: _error_handler(400, "BadRequest"),
    QueueFull: _error_handler(503, "ServiceUnavailable"),
    EngineStopped: _error_handler(503, "ServiceUnavailable"),
    TimeoutError: _error_handler(503, "ServiceUnavailable"),
    HTTPException: _http_error,
    Exception: _internal_error,
}

ROUTES = [
    generate,
    chat_completions,
    models,
    model_info,
    server_info,
    weight_version,
    health,
    health_generate,
    update_weights_from_disk,
    pause_generation,
    continue_generation,
    flush_cache,
    abort_request,
    metrics,
]


def create_app(config: ServeConfig) -> Litestar:
    """The app; the model loads and the engine starts at application startup."""

    def startup(app: Litestar) -> None:
        app.state.server = ServerState(config)
        log.info(
            "embedded model server ready: %s (weights %s)",
            app.state.server.model_path,
            config.weight_version,
        )

    def shutdown(app: Litestar) -> None:
        server = getattr(app.state, "server", None)
        if server is not None:
            server.close()

    return Litestar(
        route_handlers=ROUTES,
        guards=[key_guard(config.api_key)] if config.api_key else [],
        exception_handlers=EXCEPTION_HANDLERS,
        on_startup=[startup],
        on_shutdown=[shutdown],
        state=State({}),
        request_max_body_size=64 * 1024 * 1024,
        openapi_config=None,
        logging_config=service_logging(),
    )


def app_from_env() -> Litestar:
    """Granian factory target: configuration comes from POLAR_EMBEDDED_CONFIG (JSON)."""
    return create_app(config_from_env())
