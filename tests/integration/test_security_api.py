"""The open doors of issue 17, closed: the scheduler's HTTP API and the proxy's admin
routes need their credentials, refused in the caller's own protocol, and a task's env
secrets never come back out of a read."""

from __future__ import annotations

import orjson
import pytest
from litestar.testing import AsyncTestClient

from services.common.registry import Registry
from services.scheduler.config import SchedulerConfig
from services.scheduler.main import create_app

pytestmark = pytest.mark.asyncio

ADMIN, READ = "adm-sec-token", "read-sec-token"
SECRET = "hunter2-plain-looking-value"  # no known key shape: redacted because it is env


def shell_task(task_id: str) -> bytes:
    return orjson.dumps(
        {
            "task_id": task_id,
            "instruction": "x",
            "agent": {"harness": "shell", "command": "id > /tmp/pwned", "env": {"K": SECRET}},
            "runtime": {
                "backend": "local",
                "env": {"DB_PASS": SECRET},
                "prepare": [{"action": "exec", "command": "true", "env": {"X": SECRET}}],
            },
        }
    )


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


async def test_scheduler_writes_and_reads_need_their_credentials(nats_url, redis_url):
    cfg = SchedulerConfig(
        nats_url=nats_url, redis_url=redis_url, admin_token=ADMIN, read_token=READ
    )
    reg = Registry.from_url(redis_url)
    async with AsyncTestClient(create_app(cfg)) as client:
        for headers in ({}, bearer("wrong"), bearer(READ)):  # the read token cannot write
            r = await client.post("/tasks", content=shell_task("sec-rce"), headers=headers)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["message"]  # the API's own error shape
            assert r.headers["www-authenticate"] == "Bearer"
        assert await reg.get_task("sec-rce") is None  # nothing registered, nothing ran

        r = await client.post("/tasks", content=shell_task("sec-ok"), headers=bearer(ADMIN))
        assert r.status_code == 201, r.text
        for path in ("/tasks/sec-ok", "/sessions/sec-ok-0000"):
            assert (await client.get(path)).status_code == 401
            assert (await client.get(path, headers=bearer("wrong"))).status_code == 401
            assert (await client.get(path, headers=bearer(READ))).status_code == 200
            assert (await client.get(path, headers=bearer(ADMIN))).status_code == 200
        assert (await client.delete("/tasks/sec-ok")).status_code == 401
        assert (await client.delete("/tasks/sec-ok", headers=bearer(READ))).status_code == 401
        assert (await client.get("/healthz")).status_code == 200  # ops stay open

        got = await client.get("/tasks/sec-ok", headers=bearer(READ))
        assert SECRET.encode() not in got.content
        spec = got.json()["spec"]
        assert spec["runtime"]["env"] == {"DB_PASS": "[redacted]"}
        assert spec["agent"]["env"] == {"K": "[redacted]"}
        assert spec["runtime"]["prepare"][0]["env"] == {"X": "[redacted]"}
        assert spec["agent"]["command"] == "id > /tmp/pwned"  # the rest as submitted
        cancel = await client.delete("/tasks/sec-ok", headers=bearer(ADMIN))
        assert cancel.status_code == 200
    await reg.close()


async def test_a_scheduler_without_tokens_keeps_its_api_closed(nats_url, redis_url):
    cfg = SchedulerConfig(nats_url=nats_url, redis_url=redis_url)
    async with AsyncTestClient(create_app(cfg)) as client:
        r = await client.post("/tasks", content=shell_task("sec-closed"))
        assert r.status_code == 401 and "no admin_token" in r.json()["error"]["message"]
        assert (await client.get("/tasks/sec-closed")).status_code == 401
