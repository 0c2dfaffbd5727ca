"""vLLM client (one worker): the I/O shell around ``vllm_wire``.

Tokens-in answers carry per-choice weight-version spans (0.32); chat answers do not, and
get the version the client last observed (``GET /weight_info``, or the one it set
itself; ``"default"`` means none was set). Pause/resume, ``/weight_info``,
``/collective_rpc`` and ``/update_weight_version`` are vLLM's dev-mode endpoints
(``VLLM_SERVER_DEV_MODE=1``); a server without them answers 404, which surfaces as
``unsupported``. Reload from disk is ``POST /collective_rpc {"method": "reload_weights",
"kwargs": {"weights_path": DIR}}`` then ``/update_weight_version``; ``reload_path``
names a deployment's own reload endpoint instead (posted ``{model_path, weight_version}``).
The tokens-in ``/inference/v1/generate`` needs ``--enable-scale-out`` (403 without it):
token mode then uses ``/v1/completions`` with a token-id prompt.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from proxy.backends import vllm_wire as wire
from proxy.backends.base import (
    BackendError,
    Capabilities,
    ChatRequest,
    ErrorKind,
    Generation,
    TokenRequest,
)
from proxy.backends.http import HttpSettings, HttpWorker
from proxy.backends.probe import (
    PROBE_MESSAGES,
    PROBE_SAMPLING,
    ProbeIds,
    int_or_none,
    problems_of,
    refusal,
    token_probe_ids,
)
from proxy.backends.sglang import ALL_MODES
from proxy.backends.wire import bad_response
from schemas.completion import UpstreamMode

_HEALTH_TIMEOUT_S = 5.0


class VLLMBackend:
    server = "vllm"

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "default",
        modes: tuple[UpstreamMode, ...] = ALL_MODES,
        http: HttpSettings | None = None,
        pause_mode: str = "abort",  # abort | wait | keep
        reload_path: str | None = None,
    ) -> None:
        self.http = HttpWorker(base_url, http)
        self.base_url = self.http.base_url
        self.model = model
        self.modes = tuple(modes)
        self.pause_mode = pause_mode
        self.reload_path = reload_path
        self.token_path: str | None = None  # chosen by the probe
        self._version: str | None = None

    # -- generation -------------------------------------------------------------------

    async def chat(self, req: ChatRequest) -> Generation:
        start = time.time()
        body = await self.http.post_json(
            "/v1/chat/completions", wire.build_chat_body(req, self.model)
        )
        gen = wire.parse_chat(self._doc(body), self.base_url, self._version)
        return msgspec.structs.replace(gen, upstream_start=start, upstream_end=time.time())

    async def generate(self, req: TokenRequest) -> Generation:
        start = time.time()
        gen = await self._generate(req, self.token_path or wire.GENERATE_PATH)
        return msgspec.structs.replace(gen, upstream_start=start, upstream_end=time.time())

    async def _generate(self, req: TokenRequest, path: str) -> Generation:
        if req.image_data:  # its token routes take ids only: images go through chat mode
            raise BackendError(
                ErrorKind.UNSUPPORTED,
                "vLLM's token-in routes take no images: serve a vision model in chat mode",
                status=400,
                worker=self.base_url,
            )
        if path == wire.GENERATE_PATH:
            body = await self.http.post_json(path, wire.build_generate_body(req, self.model))
            return wire.parse_generate(self._doc(body), req, self.base_url, self._version)
        body = await self.http.post_json(path, wire.build_completions_body(req, self.model))
        return wire.parse_completions(self._doc(body), req, self.base_url, self._version)

    # -- start-up probe ---------------------------------------------------------------

    async def probe(self, input_ids: ProbeIds | None = None) -> Capabilities:
        version = self._doc(await self.http.get_json("/version")).get("version")
        models = self._doc(await self.http.get_json("/v1/models")).get("data") or [{}]
        card = models[0]
        if self.model == "default" and card.get("id"):
            self.model = card["id"]
        _, self._version = await self._weight_info()
        caps = Capabilities(
            server=self.server,
            base_url=self.base_url,
            version=None if version is None else str(version),
            model=self.model,
            model_path=card.get("root"),
            context_length=int_or_none(card.get("max_model_len")),
            weight_version=self._version,
        )
        chat_ok = await self._probe_chat(caps) if UpstreamMode.CHAT in self.modes else None
        token_ok = (
            await self._probe_token(caps, input_ids) if UpstreamMode.TOKEN in self.modes else None
        )
        return msgspec.structs.replace(
            caps, chat_token_ids=chat_ok, token_mode=token_ok, token_endpoint=self.token_path
        )

    async def _probe_chat(self, caps: Capabilities) -> bool:
        req = ChatRequest(session_id="probe", messages=PROBE_MESSAGES, sampling=PROBE_SAMPLING)
        body = await self.http.post_json(
            "/v1/chat/completions", wire.build_chat_body(req, self.model)
        )
        problems = problems_of(lambda: wire.parse_chat(self._doc(body), self.base_url))
        if problems:
            raise refusal(self.server, caps.version, self.base_url, "chat", problems)
        return True

    async def _probe_token(self, caps: Capabilities, input_ids: ProbeIds | None) -> bool:
        """Newest tokens-in endpoint first; completions with a token prompt otherwise."""
        req = TokenRequest(
            session_id="probe", input_ids=token_probe_ids(input_ids), sampling=PROBE_SAMPLING
        )
        problems: list[str] = []
        for path in (wire.GENERATE_PATH, wire.COMPLETIONS_PATH):
            try:
                await self._generate(req, path)
            except BackendError as exc:
                # 403: the endpoint exists but is off (vLLM without --enable-scale-out)
                if exc.kind not in (ErrorKind.NOT_FOUND, ErrorKind.BAD_RESPONSE) and (
                    exc.status != 403
                ):
                    raise
                problems.append(f"{path}: {exc.message}")
                continue
            self.token_path = path
            return True
        raise refusal(self.server, caps.version, self.base_url, "token", problems)

    # -- health and weight-update control ----------------------------------------------

    async def health(self) -> bool:
        try:
            await self.http.request("GET", "/health", timeout_s=_HEALTH_TIMEOUT_S)
        except BackendError:
            return False
        return True

    async def pause(self) -> None:
        await self._control("POST", "/pause", params={"mode": self.pause_mode})

    async def resume(self) -> None:
        await self._control("POST", "/resume")

    async def flush_cache(self) -> None:
        await self._control("POST", "/reset_prefix_cache")

    async def update_weights_from_disk(self, path: str, version: str | None = None) -> str | None:
        if self.reload_path is not None:
            await self._control(
                "POST", self.reload_path, {"model_path": path, "weight_version": version}
            )
        else:
            await self._control("POST", "/collective_rpc", wire.reload_weights_body(path))
        # the prefix cache holds KV the old weights computed: a hit would mix the two
        await self.flush_cache()
        if version is not None:
            await self._control("POST", "/update_weight_version", {"new_version": version})
            self._version = version
        return self._version

    async def weight_version(self) -> str | None:
        answers, version = await self._weight_info()
        if answers:  # the server's word, "default" (None) included; else the one it set
            self._version = version
        return self._version

    async def aclose(self) -> None:
        await self.http.aclose()

    # -- helpers ----------------------------------------------------------------------

    async def _weight_info(self) -> tuple[bool, str | None]:
        """(the server has /weight_info, the version it reports)."""
        try:
            doc = self._doc(await self.http.get_json("/weight_info"))
        except BackendError as exc:
            if exc.kind is ErrorKind.NOT_FOUND:
                return False, None
            raise
        return True, wire.version_or_none(doc.get("weight_version"))

    async def _control(self, method: str, path: str, body: Any = None, params=None) -> None:
        try:
            await self.http.request(method, path, body, params=params)
        except BackendError as exc:
            if exc.kind is ErrorKind.NOT_FOUND:
                raise BackendError(
                    ErrorKind.UNSUPPORTED,
                    f"{self.base_url}: vLLM has no {path} here (its RL endpoints need "
                    "VLLM_SERVER_DEV_MODE=1 in the server's environment)",
                    status=404,
                    worker=self.base_url,
                ) from None
            raise

    def _doc(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad_response(f"expected a JSON object, got {type(body).__name__}", self.base_url)
        return body
