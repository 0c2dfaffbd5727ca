"""Pushing a checkpoint to the engines through the proxy's weight-update path."""

from __future__ import annotations

import asyncio

import httpx


class SyncError(RuntimeError):
    """The proxy or an engine refused the new weights."""


async def push_weights(
    client: httpx.AsyncClient,
    proxy_url: str,
    model_path: str,
    version: str,
    *,
    admin_token: str | None = None,
    attempts: int = 5,
) -> str:
    """POST /admin/update_weights; returns the version the engines now serve. Connection
    failures are retried (the proxy may be restarting); a refusal is final."""
    headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
    body = {"model_path": model_path, "version": version}
    for attempt in range(attempts):
        try:
            r = await client.post(
                f"{proxy_url}/admin/update_weights", json=body, headers=headers, timeout=300
            )
        except httpx.TransportError as exc:
            if attempt + 1 == attempts:
                raise SyncError(f"proxy at {proxy_url} unreachable: {exc!r}") from None
            await asyncio.sleep(0.5 * 2**attempt)
            continue
        try:
            answer = r.json()
        except ValueError:
            answer = {"error": r.text[:300]}
        if r.status_code != 200 or not answer.get("ok"):
            raise SyncError(f"weight update to {version} refused ({r.status_code}): {answer}")
        served = str(answer.get("weight_version"))
        if served != version:
            raise SyncError(f"asked for weight version {version}, the engines serve {served}")
        return served
    raise AssertionError("unreachable")
