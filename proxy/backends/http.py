"""One pooled HTTP client per worker; the only place aiohttp exceptions are seen.

aiohttp rather than httpx: on this project's target (<= 1 ms added, > 1000 req/s per
core) aiohttp measured ~3-4x faster sequentially and ~10x at 64 concurrent requests
(tests/bench/bench_backend_http.py). Bodies are encoded and decoded with orjson.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
from msgspec import Struct

from proxy.backends.base import BackendError, ErrorKind
from proxy.backends.errors import error_from_response

_JSON = {"content-type": "application/json"}


class HttpSettings(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    timeout_s: float = 900.0  # one non-streaming generation can be long
    connect_timeout_s: float = 3.0
    max_connections: int = 1024
    # Below the engines' server keep-alive (uvicorn: 5 s) so a pooled connection is never
    # one the server already closed.
    keepalive_s: float = 4.0
    api_key: str | None = None


class HttpWorker:
    """JSON over HTTP to one engine worker at ``base_url``."""

    def __init__(self, base_url: str, settings: HttpSettings | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.settings = settings or HttpSettings()
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            s = self.settings
            headers = {"authorization": f"Bearer {s.api_key}"} if s.api_key else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=s.max_connections, keepalive_timeout=s.keepalive_s
                ),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=s.connect_timeout_s, sock_read=s.timeout_s
                ),
                headers=headers,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> bytes:
        """The response body of a 2xx answer; any other outcome is a ``BackendError``."""
        data = None if body is None else orjson.dumps(body)
        try:
            return await self._send(method, path, data, params, timeout_s)
        except aiohttp.ServerDisconnectedError:
            # A pooled connection the server dropped between requests: one fresh try.
            # A worker that is really gone then fails to connect, and that is final.
            return await self._send_translated(method, path, data, params, timeout_s)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._translate(exc) from None

    async def _send_translated(self, method, path, data, params, timeout_s) -> bytes:
        try:
            return await self._send(method, path, data, params, timeout_s)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._translate(exc) from None

    async def _send(self, method, path, data, params, timeout_s) -> bytes:
        timeout = None if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        async with self._client().request(
            method,
            self.base_url + path,
            data=data,
            params=params,
            headers=_JSON if data is not None else None,
            timeout=timeout,
        ) as resp:
            payload = await resp.read()
            if resp.status >= 400:
                raise error_from_response(resp.status, payload, self.base_url)
            return payload

    async def get_json(self, path: str, *, timeout_s: float | None = None) -> Any:
        return _decode(await self.request("GET", path, timeout_s=timeout_s))

    async def post_json(self, path: str, body: Any = None, **kw: Any) -> Any:
        return _decode(await self.request("POST", path, body, **kw))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _translate(self, exc: BaseException) -> BackendError:
        where = f"{self.base_url}: "
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return BackendError(
                ErrorKind.UNAVAILABLE, where + "connect timed out", worker=self.base_url
            )
        if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
            return BackendError(ErrorKind.TIMEOUT, where + "timed out", worker=self.base_url)
        detail = f"{type(exc).__name__}: {exc}"
        return BackendError(ErrorKind.UNAVAILABLE, where + detail, worker=self.base_url)


def _decode(payload: bytes) -> Any:
    if not payload:
        return None
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        # Some control endpoints (SGLang /flush_cache) answer with plain text.
        return payload.decode("utf-8", "replace")
