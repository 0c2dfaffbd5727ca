"""`polar up` with every service on `port: 0`: the ports it picks reach every service that
needs them, so a harness session talks to this stack's proxy (not 127.0.0.1:8200) and the
proxy to this stack's model (not 127.0.0.1:30000)."""

import asyncio

import httpx
import orjson
import pytest

from infra import credentials, devstack
from infra.catalog import SERVICES
from infra.topology import parse_topology
from schemas import subjects as S
from services.cli.demo import DEMO, demo_task
from services.client import TrajectoryClient
from services.common.bus import Bus

pytestmark = pytest.mark.timeout(400)


def port_zero_topology(state_dir, nats_url: str, redis_url: str) -> str:
    model = (
        f"{{port: 0, config: {{policy: '{DEMO / 'policy.yaml'}', served_model_name: polar-tiny}}}}"
    )
    others = "".join(
        f"  {name}: {{port: 0}}\n"
        for name, kind in SERVICES.items()
        if name != "model" and not kind.opt_in  # the trainer needs a config of its own
    )
    return f"""
nats_url: {nats_url}
redis_url: {redis_url}
state_dir: '{state_dir}'
startup_timeout_seconds: 240
nodes: [{{name: node0, max_init: 1, ready_buffer: 1, max_run: 1}}]
services:
  model: {model}
{others}"""


async def one_trajectory(nats_url: str, task: dict):
    bus = await Bus.open(nats_url, "ports-test")
    try:
        async with TrajectoryClient(
            nats_url, durable="ports-trainer", task_ids=[task["task_id"]]
        ) as client:
            await bus.js.publish(S.TASKS_SUBMIT, orjson.dumps(task))
            async for group in client.groups():
                await group.commit()
                return group.trajectories[0]
    finally:
        await bus.close()


def test_port_zero_stack_sends_the_harness_to_its_own_proxy(tmp_path, fresh_servers):
    # a whole stack consumes the task queues: its own servers, not the session's shared ones
    nats_url, redis_url = fresh_servers
    topo = parse_topology(port_zero_topology(tmp_path, nats_url, redis_url))
    state = devstack.up(topo)
    try:
        ports = {p.name: p.port for p in state.procs}
        assert ports["proxy"] not in (0, SERVICES["proxy"].port)
        assert ports["model"] not in (0, SERVICES["model"].port)
        task = {**demo_task("ports-0"), "num_samples": 1}
        traj = asyncio.run(asyncio.wait_for(one_trajectory(nats_url, task), 300))
        # the proxy presented the engine key `up` generated; nobody else has it (issue 17)
        model = f"http://127.0.0.1:{ports['model']}"
        key = credentials.load(tmp_path).engine_key
        refused = httpx.post(f"{model}/continue_generation", trust_env=False)
        assert refused.status_code == 401 and refused.json()["code"] == 401, refused.text
        keyed = {"authorization": f"Bearer {key}"}
        assert httpx.get(f"{model}/get_weight_version", headers=keyed, trust_env=False).is_success
        # the trainer's controls reach the keyed engine through the proxy's /admin/*
        proxy = f"http://127.0.0.1:{ports['proxy']}/admin"
        admin = {"authorization": f"Bearer {credentials.load(tmp_path).admin_token}"}
        version = httpx.get(f"{proxy}/weight_version", headers=admin, trust_env=False)
        assert version.json() == {"weight_version": "1"}, version.text
        flushed = httpx.post(f"{proxy}/flush_cache", headers=admin, trust_env=False)
        assert flushed.status_code == 200, flushed.text
    finally:
        devstack.down(tmp_path)
    # the agent's model calls were captured by this stack's proxy, served by its model
    assert traj.stats.completions == 5, traj.status
    assert traj.reward == 1.0 and traj.eval_status == "ok"
