"""One pooled HTTP client per worker; the only place transport errors become data.

The client is ``proxy.io.rawhttp``, a bare asyncio HTTP/1.1 keep-alive pool: the
engines speak plain JSON over HTTP/1.1, and aiohttp, measured before, was ~23% of the
proxy's CPU on the engine-call path (tests/bench/bench_backend_http.py compares them).
Bodies are encoded and decoded with orjson.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import orjson
from msgspec import Struct

from proxy.backends.base import BackendError, ErrorKind
from proxy.backends.errors import error_from_response
from proxy.io import rawhttp


class HttpSettings(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # A request's deadline, from send to last byte; one non-streaming generation can be long.
    timeout_s: float = 900.0
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
        self._pool: rawhttp.ConnectionPool | None = None

    def _client(self) -> rawhttp.ConnectionPool:
        if self._pool is None:
            s = self.settings
            headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else None
            self._pool = rawhttp.ConnectionPool(
                self.base_url,
                limit=s.max_connections,
                keepalive_s=s.keepalive_s,
                connect_timeout_s=s.connect_timeout_s,
                headers=headers,
            )
        return self._pool

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
        target = f"{path}?{urlencode(params)}" if params else path
        pool = self._client()
        request = pool.encode(method, target, data)
        try:
            resp = await pool.send(request, timeout_s or self.settings.timeout_s)
        except (rawhttp.ConnectFailed, rawhttp.Disconnected, rawhttp.ProtocolError) as exc:
            raise self._error(ErrorKind.UNAVAILABLE, f"{type(exc).__name__}: {exc}") from None
        except rawhttp.ConnectTimeout:
            raise self._error(ErrorKind.UNAVAILABLE, "connect timed out") from None
        except rawhttp.RequestTimeout:
            raise self._error(ErrorKind.TIMEOUT, "timed out") from None
        if resp.status >= 400:
            raise error_from_response(resp.status, resp.body, self.base_url)
        return resp.body

    async def get_json(self, path: str, *, timeout_s: float | None = None) -> Any:
        return _decode(await self.request("GET", path, timeout_s=timeout_s))

    async def post_json(self, path: str, body: Any = None, **kw: Any) -> Any:
        return _decode(await self.request("POST", path, body, **kw))

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _error(self, kind: ErrorKind, detail: str) -> BackendError:
        return BackendError(kind, f"{self.base_url}: {detail}", worker=self.base_url)


def _decode(payload: bytes) -> Any:
    if not payload:
        return None
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        # Some control endpoints (SGLang /flush_cache) answer with plain text.
        return payload.decode("utf-8", "replace")
