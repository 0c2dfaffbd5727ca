"""SGLang client (one worker): the I/O shell around ``sglang_wire``.

Also serves the embedded CPU model server, which speaks the same surface. Endpoints
renamed across versions are tried newest first and the one that answers is remembered
(``/model_info`` then ``/get_model_info``; ``/server_info`` then ``/get_server_info``).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from proxy.backends import sglang_wire as wire
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
from proxy.backends.wire import bad_response
from schemas.completion import UpstreamMode

ALL_MODES = (UpstreamMode.CHAT, UpstreamMode.TOKEN)
_MODEL_INFO = ("/model_info", "/get_model_info")
_SERVER_INFO = ("/server_info", "/get_server_info")
_HEALTH_TIMEOUT_S = 5.0


class SGLangBackend:
    server = "sglang"

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "default",
        modes: tuple[UpstreamMode, ...] = ALL_MODES,
        http: HttpSettings | None = None,
        pause_mode: str | None = None,  # abort | retract | in_place (SGLang >= 0.5.5)
    ) -> None:
        self.http = HttpWorker(base_url, http)
        self.base_url = self.http.base_url
        self.model = model
        self.modes = tuple(modes)
        self.pause_mode = pause_mode
        self._paths: dict[tuple[str, ...], str] = {}

    # -- generation -------------------------------------------------------------------

    async def chat(self, req: ChatRequest) -> Generation:
        start = time.time()
        body = await self.http.post_json(
            "/v1/chat/completions", wire.build_chat_body(req, self.model)
        )
        gen = wire.parse_chat(self._doc(body), self.base_url)
        return msgspec.structs.replace(gen, upstream_start=start, upstream_end=time.time())

    async def generate(self, req: TokenRequest) -> Generation:
        start = time.time()
        body = await self.http.post_json("/generate", wire.build_generate_body(req))
        gen = wire.parse_generate(self._doc(body), req, self.base_url, self.model)
        return msgspec.structs.replace(gen, upstream_start=start, upstream_end=time.time())

    # -- start-up probe ---------------------------------------------------------------

    async def probe(self, input_ids: ProbeIds | None = None) -> Capabilities:
        model_info = self._doc(await self._get_first(_MODEL_INFO))
        server_info = await self._server_info()
        version = server_info.get("version")
        if self.model == "default" and server_info.get("served_model_name"):
            self.model = server_info["served_model_name"]
        caps = Capabilities(
            server=self.server,
            base_url=self.base_url,
            version=None if version is None else str(version),
            model=self.model,
            model_path=model_info.get("model_path"),
            context_length=int_or_none(server_info.get("context_length")),
            weight_version=_str_or_none(model_info.get("weight_version")),
        )
        chat_ok = await self._probe_chat(caps) if UpstreamMode.CHAT in self.modes else None
        token_ok = (
            await self._probe_token(caps, input_ids) if UpstreamMode.TOKEN in self.modes else None
        )
        return msgspec.structs.replace(
            caps,
            chat_token_ids=chat_ok,
            token_mode=token_ok,
            token_endpoint="/generate" if token_ok else None,
        )

    async def _server_info(self) -> dict[str, Any]:
        try:
            return self._doc(await self._get_first(_SERVER_INFO))
        except BackendError as exc:
            if exc.kind is ErrorKind.NOT_FOUND:
                return {}
            raise

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
        req = TokenRequest(
            session_id="probe", input_ids=token_probe_ids(input_ids), sampling=PROBE_SAMPLING
        )
        body = await self.http.post_json("/generate", wire.build_generate_body(req))
        problems = problems_of(lambda: wire.parse_generate(self._doc(body), req, self.base_url))
        if problems:
            raise refusal(self.server, caps.version, self.base_url, "token", problems)
        return True

    # -- health and weight-update control ----------------------------------------------

    async def health(self) -> bool:
        try:
            await self.http.request("GET", "/health", timeout_s=_HEALTH_TIMEOUT_S)
        except BackendError:
            return False
        return True

    async def pause(self) -> None:
        body = None if self.pause_mode is None else {"mode": self.pause_mode}
        await self.http.request("POST", "/pause_generation", body)

    async def resume(self) -> None:
        await self.http.request("POST", "/continue_generation")

    async def update_weights_from_disk(self, path: str, version: str | None = None) -> str | None:
        body: dict[str, Any] = {"model_path": path}
        if version is not None:
            body["weight_version"] = version
        answer = await self.http.post_json("/update_weights_from_disk", body)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise BackendError(
                ErrorKind.BAD_REQUEST, str(answer.get("message")), worker=self.base_url
            )
        return await self.weight_version()

    async def flush_cache(self) -> None:
        await self.http.request("POST", "/flush_cache")

    async def weight_version(self) -> str | None:
        info = self._doc(await self._get_first(_MODEL_INFO))
        return _str_or_none(info.get("weight_version"))

    async def aclose(self) -> None:
        await self.http.aclose()

    # -- helpers ----------------------------------------------------------------------

    async def _get_first(self, paths: tuple[str, ...]) -> Any:
        """GET the first of ``paths`` the server knows (newest name first)."""
        known = self._paths.get(paths)
        if known is not None:
            return await self.http.get_json(known)
        last: BackendError | None = None
        for path in paths:
            try:
                doc = await self.http.get_json(path)
            except BackendError as exc:
                if exc.kind is not ErrorKind.NOT_FOUND:
                    raise
                last = exc
                continue
            self._paths[paths] = path
            return doc
        assert last is not None
        raise last

    def _doc(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad_response(f"expected a JSON object, got {type(body).__name__}", self.base_url)
        return body


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
