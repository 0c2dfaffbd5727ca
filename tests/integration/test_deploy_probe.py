"""The deploy probe's HTTP submission (infra/deploy/probe.py ``--scheduler``): a
scheduler that took its tokens from the environment, as the deployments give them
(POLAR_ADMIN_TOKEN), takes the probe's task with that token and refuses it without."""

from __future__ import annotations

import json

import pytest
from litestar.testing import AsyncTestClient

from infra.deploy.probe import Refused, probe_task, submit_http
from services.common.registry import Registry
from services.common.settings import load
from services.scheduler.config import SchedulerConfig
from services.scheduler.main import create_app

BASE = "http://testserver.local"


async def test_the_probe_submits_with_the_deployments_admin_token(nats_url, redis_url):
    env = {
        "POLAR_CONFIG": json.dumps({"nats_url": nats_url, "redis_url": redis_url}),
        "POLAR_ADMIN_TOKEN": "pa_deploy",
        "POLAR_READ_TOKEN": "pr_deploy",
    }
    cfg = load(SchedulerConfig, env)
    async with AsyncTestClient(create_app(cfg)) as client:
        with pytest.raises(Refused, match="no POLAR_ADMIN_TOKEN given.*401"):
            await submit_http(BASE, None, probe_task("probe-none", 1), client=client)
        with pytest.raises(Refused, match="401"):
            await submit_http(BASE, "pr_deploy", probe_task("probe-read", 1), client=client)
        await submit_http(BASE, "pa_deploy", probe_task("probe-admin", 2), client=client)
        record = await client.get(
            "/tasks/probe-admin", headers={"authorization": "Bearer pr_deploy"}
        )
        assert record.status_code == 200, record.text
        assert len(record.json()["sessions"]) == 2
    reg = Registry.from_url(redis_url)
    try:
        assert await reg.get_task("probe-none") is None
        assert await reg.get_task("probe-read") is None
    finally:
        await reg.close()
