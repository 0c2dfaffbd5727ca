"""The proxy's HTTP surface: every protocol's routes, at the root and under ``/s/{token}``.

Per request: find the session (token from the path, else ``Authorization: Bearer``,
``x-api-key``, ``x-goog-api-key`` or ``?key=``), read the body under a size limit, parse
it with the protocol into a ``Conversation``, hand it to the completion handler, render
the ``AssistantTurn`` back. Every failure is an error in the caller's protocol. The
session lookup is under way while the body is read and parsed and the handler prepares
the call (CPU work), so its round trip costs no waiting of its own; an unknown token is
still a 401 before any 400.

The handler runs in the request's own task; a client that disconnects cancels it (it
sees ``CancelledError``): at once under ``proxy.io.native``, which sees the connection
close, and over ASGI once a watcher started past ``QUICK_SECONDS`` sees it. Streams:
the whole event sequence is sent once the answer is there; a call still running after
``keepalive_seconds`` gets its stream started by a pump that sends protocol-legal
keep-alives until then (a failure then becomes the protocol's in-stream error; before,
it keeps its real status). ``proxy.io.serving`` routes and serves every request, the
operator's routes (``OperatorRoute``: health, metrics, admin) too; their failures, and
unknown paths and wrong methods, answer in the one error body every SDK reads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import orjson
from msgspec import Struct

from proxy.conversation import AssistantTurn, Conversation, TextPart
from proxy.errors import ErrorKind, ProtocolError, ProxyError, UpstreamError
from proxy.io.serving import (
    SSE,
    BodyTooLarge,
    CallRequest,
    ClientGone,
    OperatorRoute,
    ProxyApp,
    ProxyRoutes,
    Reply,
    RequestHead,
    Served,
)
from proxy.protocols import PROTOCOLS, Endpoint, ProtocolSpec, ReplyIds, Route
from proxy.protocols import models as generic
from proxy.sse import encode_all
from services.common.logs import service_logging

log = logging.getLogger("polar.proxy")

PROBE_PATHS = ("/", "/api/hello")
T = TypeVar("T")
QUICK_SECONDS = 0.05  # most answers are back sooner: no disconnect watcher for those


class SessionInfo(Struct, frozen=True, kw_only=True):
    """A session as its lookup found it for one request (``proxy.sessions`` fills it):
    what the completion handler needs of the session for the call."""

    session_id: str
    model: str = ""  # the model name the harness was configured with
    attempt: int = 0
    task_id: str = ""
    states: list[bytes] = []  # the attempt's stored TITO states, raw, newest first
    seq: int | None = None  # the call's number, when the lookup took one
    replay: bytes = b""  # a replay's session: its task's ReplaySpec json (proxy/replay.py)


# token, and whether the lookup is for a model call (the resolver may number it then)
SessionResolver = Callable[[str, bool], Awaitable[SessionInfo | None]]
# a model call's session was looked up (and maybe numbered), but the call will not be made
UnusedCall = Callable[[SessionInfo, str, str], Awaitable[None]]
# A model call in two steps: prepared from its request (conversation, protocol name, raw
# body, headers) while the session lookup is under way, then made for the session. A
# preparation raises nothing: what fails in it fails when the call is made, so a 401
# still comes before it. The call returns its answer rendered by ``Render``, which the
# handler runs while the capture's round trips are out.
Render = Callable[[AssistantTurn], Any]
ModelCall = Callable[[SessionInfo, Render], Awaitable[Any]]
CompletionHandler = Callable[[Conversation, str, bytes, Mapping[str, str]], ModelCall]
# count_tokens: (session, conversation, protocol name, raw body, headers) -> tokens; a
# counter numbers and captures the call like a model call (a tagged side call)
TokenCounter = Callable[[SessionInfo, Conversation, str, bytes, Mapping[str, str]], Awaitable[int]]


def unprepared(
    handler: Callable[
        [SessionInfo, Conversation, str, bytes, Mapping[str, str]], Awaitable[AssistantTurn]
    ],
) -> CompletionHandler:
    """A handler with nothing to prepare, in the two-step shape ``create_app`` takes."""

    def prepare(conv: Conversation, protocol: str, raw: bytes, headers: Mapping[str, str]):
        async def call(session: SessionInfo, render: Render) -> Any:
            return render(await handler(session, conv, protocol, raw, headers))

        return call

    return prepare


def create_app(
    completion_handler: CompletionHandler,
    session_resolver: SessionResolver,
    *,
    count_tokens: TokenCounter | None = None,
    unused_call: UnusedCall | None = None,
    max_body_bytes: int = 16 * 1024 * 1024,
    keepalive_seconds: float = 10.0,
    operator_routes: Sequence[OperatorRoute] = (),
    protocols: Sequence[ProtocolSpec] = PROTOCOLS,
    lifespan: Sequence[Any] = (),
) -> ProxyApp:
    proxy = _Proxy(
        completion_handler,
        session_resolver,
        count_tokens,
        unused_call,
        max_body_bytes,
        keepalive_seconds,
    )
    service_logging().configure()
    served = Served(
        call=proxy.serve,
        head=proxy.serve_head,
        operator=proxy.serve_operator,
        wrong_method=generic_error(ErrorKind.BAD_REQUEST, "Method Not Allowed", 405),
        not_found=generic_error(ErrorKind.NOT_FOUND, "Not Found"),
        probe=Reply(200),  # empty, as the CLIs that send them expect
        refused=lambda status, reason: generic_error(ErrorKind.BAD_REQUEST, reason, status),
    )
    routes = ProxyRoutes(served, protocols, operator_routes, probes=PROBE_PATHS)
    return ProxyApp(routes, lifespan)


class _Proxy:
    def __init__(
        self,
        handler: CompletionHandler,
        resolver: SessionResolver,
        counter: TokenCounter | None,
        unused: UnusedCall | None,
        max_body: int,
        keepalive: float,
    ):
        self.handler = handler
        self.resolver = resolver
        self.counter = counter
        self.unused = unused
        self.max_body = max_body
        self.keepalive = keepalive

    async def serve_head(self, spec: ProtocolSpec, r: Route, request: RequestHead) -> Reply:
        """A route that reads no body (the models list, one model)."""
        try:
            return await self.models(spec, await self.session(self.lookup(request, False)), request)
        except ProxyError as e:
            return error_response(spec, e.kind, e.message, e.param)
        except Exception:
            log.exception("unexpected error serving %s %s", r.method, r.path)  # no token in logs
            return error_response(spec, ErrorKind.INTERNAL, "internal error in the proxy")

    async def serve_operator(self, _spec: None, r: OperatorRoute, request: CallRequest) -> Reply:
        """An operator's route (health, metrics, admin): its own answer, or the generic
        error body for what it left unanswered."""
        try:
            return await r.answer(request)
        except BodyTooLarge:
            reply = generic_error(ErrorKind.TOO_LARGE, "request body is too large", 413)
            reply.close = True  # the rest of the body is still on its way
            return reply
        except ClientGone:
            return Reply(499)
        except Exception:
            log.exception("unexpected error serving %s %s", r.method, r.path)
            return generic_error(ErrorKind.INTERNAL, "internal error in the proxy")

    async def serve(self, spec: ProtocolSpec, r: Route, request: CallRequest) -> Reply:
        unread = False  # a body over the limit is left unread
        try:
            endpoint = (
                r.endpoint if isinstance(r.endpoint, Endpoint) else r.endpoint(request.path_params)
            )
            generate = endpoint is Endpoint.GENERATE
            # numbered (and so captured): model calls, and count_tokens when a counter
            # captures it
            for_call = generate or (endpoint is Endpoint.COUNT_TOKENS and self.counter is not None)
            lookup = self.lookup(request, for_call)  # under way while the body is read
            if request.headers.get("expect", "").lower() == "100-continue":
                # the 100 Continue goes out as the body is read: only to a valid token
                # (an unknown one is a 401 here, before it); later awaits get the session
                lookup = asyncio.sleep(0, await self.session(lookup))
            if endpoint is Endpoint.MODELS or endpoint is Endpoint.MODEL:
                return await self.models(spec, await self.session(lookup), request)
            try:
                conv, raw = await self.conversation(spec, request)
            except (ProxyError, ClientGone) as e:
                unread = isinstance(e, ProxyError) and e.status == 413
                session = await self.session(lookup)  # an unknown token is a 401 before any 400
                if for_call and self.unused is not None:
                    reason = e.message if isinstance(e, ProxyError) else "client disconnected"
                    await self.unused(session, spec.name, reason)
                raise e from None
            except BaseException:
                _drop(lookup)
                raise
            # a model call's CPU work runs while the lookup's round trip is out
            call = self.handler(conv, spec.name, raw, request.headers) if generate else None
            session = await self.session(lookup)
            if not conv.model:
                conv = msgspec.structs.replace(conv, model=session.model)
            if call is not None:
                return await self.generate(spec, session, conv, call, request)
            return await self.count(spec, session, conv, raw, request.headers)
        except ProxyError as e:
            reply = error_response(spec, e.kind, e.message, e.param)
            # the rest of the body is still on its way: the client must not send its next
            # request after it on this connection (RFC 9112 9.6)
            reply.close = unread
            return reply
        except ClientGone:
            return Reply(499)
        except Exception:
            log.exception("unexpected error serving %s %s", r.method, r.path)  # no token in logs
            return error_response(spec, ErrorKind.INTERNAL, "internal error in the proxy")

    def lookup(self, request: RequestHead, for_call: bool) -> Awaitable[SessionInfo | None]:
        token = (
            request.path_params.get("token")
            or token_from_headers(request.headers)
            or request.query_params.get("key")
        )
        if not token:
            raise ProtocolError(
                401, "missing session token: use the /s/<token>/ base URL or send it as the API key"
            )
        try:
            return self.resolver(token, for_call)
        except Exception as e:  # judged where the lookup is awaited, like a later failure
            return _failed(e)

    async def session(self, lookup: Awaitable[SessionInfo | None]) -> SessionInfo:
        try:
            session = await lookup
        except Exception as e:
            log.warning("session lookup failed: %r", e)
            raise UpstreamError(503, "session registry unavailable", ErrorKind.UNAVAILABLE) from e
        if session is None:
            raise ProtocolError(401, "invalid or expired session token")
        return session

    async def conversation(
        self, spec: ProtocolSpec, request: CallRequest
    ) -> tuple[Conversation, bytes]:
        try:
            raw = await request.read(self.max_body)
        except BodyTooLarge:
            raise ProtocolError(413, f"request body is larger than {self.max_body} bytes") from None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ProtocolError(400, f"request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise ProtocolError(400, "request body must be a JSON object")
        assert spec.parse_request is not None
        try:
            conv = spec.parse_request(body, request.path_params, request.query_params)
        except ProxyError:
            raise
        except Exception as e:  # a parser gap must still be the caller's 400, never a 500
            log.warning("unparsed %s request: %r", spec.name, e, exc_info=True)
            raise ProtocolError(400, f"malformed request: {e}") from e
        return conv, raw

    async def generate(
        self,
        spec: ProtocolSpec,
        session: SessionInfo,
        conv: Conversation,
        call: ModelCall,
        request: CallRequest,
    ) -> Reply:
        ids = ReplyIds.new()
        if not conv.stream:
            assert spec.render_response is not None
            render_json = spec.render_response

            def rendered(turn: AssistantTurn) -> Reply:
                return json_response(200, render_json(turn, conv, ids))

            return await answer_unless_gone(call(session, rendered), request)
        answer = call(session, lambda turn: stream_body(spec, conv, ids, turn))
        return await self.stream(spec, conv, ids, answer, request)

    async def stream(
        self,
        spec: ProtocolSpec,
        conv,
        ids: ReplyIds,
        answer: Awaitable[bytes],
        request: CallRequest,
    ) -> Reply:
        """Streamed: the whole event sequence once the answer is there. Past
        ``keepalive`` seconds a pump starts the stream and sends keep-alives until then;
        before that, a failure still gets its real status."""
        assert spec.keepalive is not None and spec.render_stream_error is not None
        pump: asyncio.Future | None = None

        def slow() -> None:
            nonlocal pump
            pump = request.loop.create_task(
                keep_alive(request, spec.keepalive(conv, ids), self.keepalive)
            )

        timer = request.loop.call_later(self.keepalive, slow)
        try:
            try:
                events = await answer_unless_gone(answer, request)
            finally:
                timer.cancel()
                if pump is not None:
                    pump.cancel()
                    await asyncio.wait({pump})
            return Reply(200, events, SSE)
        except Exception as e:
            if not request.started or isinstance(e, ClientGone):
                raise  # not streaming yet: the error keeps its real status
            if isinstance(e, ProxyError):
                kind, message = e.kind, e.message
            else:  # the stream is open: even a bug ends it in the protocol's own error
                log.exception("completion handler failed mid-stream")
                kind, message = ErrorKind.INTERNAL, "internal error in the proxy"
            return Reply(200, encode_all(spec.render_stream_error(kind, message, conv, ids)), SSE)

    async def count(
        self, spec: ProtocolSpec, session: SessionInfo, conv: Conversation, raw: bytes, headers
    ) -> Reply:
        if self.counter is None:
            n = estimate_tokens(conv)
        else:
            n = await self.counter(session, conv, spec.name, raw, headers)
        assert spec.render_count_tokens is not None
        return json_response(200, spec.render_count_tokens(n))

    async def models(self, spec: ProtocolSpec, session: SessionInfo, request: RequestHead) -> Reply:
        assert spec.render_models is not None
        return json_response(200, spec.render_models(session.model, request.path_params))


async def _failed(exc: Exception) -> None:
    raise exc


def _drop(pending: Awaitable) -> None:
    """A lookup nobody will wait for (the request is being cancelled)."""
    if isinstance(pending, Coroutine):
        pending.close()
    elif isinstance(pending, asyncio.Future):
        pending.cancel()


def token_from_headers(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return headers.get("x-api-key") or headers.get("x-goog-api-key") or None


async def answer_unless_gone(call: Awaitable[T], request: CallRequest) -> T:
    """Run the handler in this request's own task; a client that disconnects cancels it.
    A server that sees the disconnect itself (``watch_gone``) calls back at once; else a
    task waits for it, started only past ``QUICK_SECONDS`` (most answers are back sooner)."""
    loop = request.loop
    me = asyncio.current_task(loop)
    assert me is not None
    left = False

    def gone() -> None:
        nonlocal left
        left = True
        me.cancel()

    if request.watch_gone(gone):
        try:
            return await call
        except asyncio.CancelledError:
            if left:
                me.uncancel()
                raise ClientGone from None
            raise
        finally:
            request.watch_gone(None)
    watcher: asyncio.Future | None = None

    def hang_up(w: asyncio.Future) -> None:
        if not w.cancelled():
            me.cancel()

    def watch() -> None:
        nonlocal watcher
        watcher = loop.create_task(request.disconnected())
        watcher.add_done_callback(hang_up)

    timer = loop.call_later(QUICK_SECONDS, watch)
    try:
        return await call
    except asyncio.CancelledError:
        if watcher is not None and watcher.done() and not watcher.cancelled():
            me.uncancel()
            raise ClientGone from None
        raise
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()


def stream_body(
    spec: ProtocolSpec, conv: Conversation, ids: ReplyIds, turn: AssistantTurn
) -> bytes:
    """The whole event sequence of an answer (a rendering failure: the in-stream error)."""
    assert spec.render_stream and spec.render_stream_error
    try:
        return encode_all(spec.render_stream(turn, conv, ids))
    except Exception:
        log.exception("could not render a %s stream", spec.name)
        return encode_all(
            spec.render_stream_error(ErrorKind.INTERNAL, "internal error in the proxy", conv, ids)
        )


async def keep_alive(request: CallRequest, frame: bytes, every: float) -> None:
    """Start the stream (200) and send ``frame`` every ``every`` seconds until cancelled."""
    await request.start_stream()
    while True:
        await request.send_chunk(frame)
        await asyncio.sleep(every)


def estimate_tokens(conv: Conversation) -> int:
    """Rough count (4 characters a token) for when no tokenizer-backed counter is wired."""
    chars = len(conv.system) + sum(
        len(p.text) for m in conv.messages for p in m.content if isinstance(p, TextPart)
    )
    chars += sum(len(c.arguments) + len(c.name) for m in conv.messages for c in m.tool_calls)
    chars += len(orjson.dumps([t.parameters for t in conv.tools])) if conv.tools else 0
    return chars // 4 + 1


def json_response(status: int, body: Any) -> Reply:
    return Reply(status, orjson.dumps(body))


def error_response(
    spec: ProtocolSpec, kind: ErrorKind, message: str, param: str | None = None
) -> Reply:
    status, body = spec.error_body(kind, message, param)
    return json_response(status, body)


def generic_error(kind: ErrorKind, message: str, status: int | None = None) -> Reply:
    """An error outside any one protocol (an unknown path, an operator's route): the
    body every SDK reads."""
    return json_response(*generic.error_body(kind, message, None, status))
