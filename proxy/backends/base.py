"""The one interface the proxy uses to reach an inference engine.

Every engine client (SGLang, vLLM, the embedded CPU server through its SGLang-compatible
surface) and the worker pool implement ``Backend``. Requests and results are frozen msgspec
Structs; failures are ``BackendError`` values carrying a kind the proxy maps to each
protocol's own error shape::

    BackendError(kind, message, status, retryable)
      kinds: context_length | bad_request | not_found | unavailable | overloaded | timeout
             | server_error | bad_response | unsupported | capability
      BackendCapabilityError  (kind=capability) the probe refuses a server that cannot
                              return token ids; raised at start, never per request

Third-party exceptions (httpx) are translated once, in ``http.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Literal, Protocol

from msgspec import Struct

FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class SamplingParams(Struct, frozen=True, kw_only=True, omit_defaults=True):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    seed: int | None = None
    extra: dict[str, Any] = {}  # engine-specific sampling keys, passed through verbatim


class ChatRequest(Struct, frozen=True, kw_only=True):
    """Upstream chat mode: the engine renders the template and parses tool calls."""

    session_id: str
    messages: list[dict[str, Any]]  # OpenAI chat shaped
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    sampling: SamplingParams = SamplingParams()
    model: str | None = None
    extra_body: dict[str, Any] = {}  # e.g. chat_template_kwargs, passed through verbatim


class RoutingAsk(Struct, frozen=True, kw_only=True):
    """Ask the engine for routing rows from position ``start`` on (engines that return
    every row ignore it); ``top_k`` is the model's experts per token."""

    start: int = 0
    top_k: int


class RoutingRows(Struct, frozen=True, kw_only=True):
    """Rows for positions ``[start, start + rows)``: ``data`` little-endian ``dtype``, or
    still the engine's base64 text in ``encoded`` (``routed.decoded`` fills ``data``)."""

    data: bytes
    encoded: str = ""
    dtype: str
    layers: int
    top_k: int
    start: int
    rows: int


class TokenRequest(Struct, frozen=True, kw_only=True):
    """Upstream token mode (TITO): the proxy rendered the prompt into ``input_ids``."""

    session_id: str
    input_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    # the prompt's images in the order of their image tokens, base64 (SGLang's image_data)
    image_data: list[str] = []
    routing: RoutingAsk | None = None  # MoE: ask for the expert routing (proxy/routing.py)


class ToolCall(Struct, frozen=True, kw_only=True):
    id: str
    name: str
    arguments: str  # a JSON document, as the engine produced it


class Generation(Struct, frozen=True, kw_only=True):
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]  # one per output id
    finish_reason: FinishReason
    weight_version: str | None = None  # the version that produced the last token
    # Where the engine says so (the embedded one does): weight_versions[i] produced the
    # output from weight_version_starts[i] on; two or more when a swap came mid-request.
    weight_versions: list[str] = []
    weight_version_starts: list[int] = []
    text: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []  # chat mode only: parsed by the engine
    matched_stop: int | str | None = None
    served_model: str = ""
    worker: str = ""  # base URL of the worker that produced it
    upstream_start: float = 0.0  # epoch seconds
    upstream_end: float = 0.0
    routing: RoutingRows | None = None  # what the engine routed, when asked (MoE)


class Capabilities(Struct, frozen=True, kw_only=True):
    """What the start-up probe found on one worker."""

    server: str  # sglang | vllm
    base_url: str
    version: str | None = None
    model: str = ""  # served model name
    model_path: str | None = None
    context_length: int | None = None
    weight_version: str | None = None
    chat_token_ids: bool | None = None  # None: chat mode not probed
    token_mode: bool | None = None  # None: token mode not probed
    token_endpoint: str | None = None  # the tokens-in path the client will use
    workers: int = 1


class ErrorKind(enum.StrEnum):
    CONTEXT_LENGTH = "context_length"
    BAD_REQUEST = "bad_request"
    NOT_FOUND = "not_found"
    UNAVAILABLE = "unavailable"  # connection refused/reset: the worker is gone
    OVERLOADED = "overloaded"
    TIMEOUT = "timeout"
    SERVER_ERROR = "server_error"
    BAD_RESPONSE = "bad_response"  # a 2xx answer missing what we asked for
    UNSUPPORTED = "unsupported"
    CAPABILITY = "capability"


RETRYABLE = frozenset(
    {ErrorKind.UNAVAILABLE, ErrorKind.OVERLOADED, ErrorKind.TIMEOUT, ErrorKind.SERVER_ERROR}
)


class BackendError(Exception):
    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        status: int | None = None,
        retryable: bool | None = None,
        worker: str = "",
    ) -> None:
        super().__init__(message)
        self.kind = ErrorKind(kind)
        self.message = message
        self.status = status
        self.retryable = self.kind in RETRYABLE if retryable is None else retryable
        self.worker = worker

    def __repr__(self) -> str:
        return f"BackendError({self.kind.value}, status={self.status}, {self.message!r})"


class BackendCapabilityError(BackendError):
    """The server cannot give what token-exact capture needs; refuse to start."""

    def __init__(self, message: str, *, worker: str = "") -> None:
        super().__init__(ErrorKind.CAPABILITY, message, retryable=False, worker=worker)


class Backend(Protocol):
    base_url: str

    async def chat(self, req: ChatRequest) -> Generation: ...
    async def generate(self, req: TokenRequest) -> Generation: ...
    # input_ids: the token probe's prompt, asked for once the engine answers
    async def probe(self, input_ids: Callable[[], list[int]] | None = None) -> Capabilities: ...
    async def health(self) -> bool: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def update_weights_from_disk(
        self, path: str, version: str | None = None
    ) -> str | None: ...
    async def flush_cache(self) -> None: ...
    async def weight_version(self) -> str | None: ...
    async def aclose(self) -> None: ...
