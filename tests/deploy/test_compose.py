"""The compose stack (infra/deploy/compose/compose.yaml) in podman, with a real task run
to its trajectories through it: the harness, in bubblewrap in the gateway container,
calls the embedded engine through the proxy container.

Needs the image (`just image`, ~3 min once) and podman-compose; ~40 s on two cores."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest

from infra.deploy.probe import describe, probe
from infra.localservers import free_port, reachable

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "infra/deploy/compose/compose.yaml"
IMAGE = os.environ.get("POLAR_IMAGE", "localhost/polar:latest")
CONTAINERS_CONF = Path(os.environ.get("POLAR_PODMAN_DIR", "/tmp/polar-podman")) / "containers.conf"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
# compose.yaml requires these (no default): the services' credentials
TOKENS = {
    "POLAR_ADMIN_TOKEN": f"pa_{uuid.uuid4().hex}",
    "POLAR_READ_TOKEN": f"pr_{uuid.uuid4().hex}",
    "POLAR_ENGINE_API_KEY": f"pe_{uuid.uuid4().hex}",
}


def _podman_env() -> dict[str, str]:
    env = dict(os.environ)
    if CONTAINERS_CONF.exists():  # runc + cgroupfs, as infra/podman/setup.sh writes it
        env["CONTAINERS_CONF"] = str(CONTAINERS_CONF)
    return env


def _missing() -> str | None:
    if shutil.which("podman-compose") is None:
        return "podman-compose is not installed (apt-get install podman-compose)"
    found = subprocess.run(["podman", "image", "exists", IMAGE], env=_podman_env())
    if found.returncode != 0:
        return f"image {IMAGE} not built: `just image` (infra/deploy/container/build.sh)"
    return None


@pytest.fixture
def stack():
    if why := _missing():
        pytest.skip(why)
    ports = {
        name: free_port()
        for name in ("POLAR_NATS_PORT", "POLAR_SCHEDULER_PORT", "POLAR_PROXY_PORT",
                     "POLAR_DASHBOARD_PORT")
    }  # fmt: skip
    env = {**_podman_env(), **TOKENS, **{k: str(v) for k, v in ports.items()}}
    project = f"polartest{uuid.uuid4().hex[:6]}"
    compose = ["podman-compose", "-f", str(COMPOSE), "-p", project]
    try:
        subprocess.run([*compose, "up", "-d"], env=env, check=True, capture_output=True)
        yield ports
    finally:
        subprocess.run([*compose, "down", "-v"], env=env, capture_output=True)
        subprocess.run(["podman", "network", "rm", "-f", f"{project}_default"], env=env,
                       capture_output=True)  # fmt: skip


def test_compose_stack_runs_a_task_to_its_trajectories(stack):
    nats = f"nats://127.0.0.1:{stack['POLAR_NATS_PORT']}"
    scheduler = f"http://127.0.0.1:{stack['POLAR_SCHEDULER_PORT']}"  # declares the streams
    proxy = f"http://127.0.0.1:{stack['POLAR_PROXY_PORT']}"
    got = asyncio.run(
        probe(nats, samples=2, timeout=180, sandbox="bwrap", wait=[scheduler, proxy],
              scheduler=scheduler, admin_token=TOKENS["POLAR_ADMIN_TOKEN"])
    )  # fmt: skip
    assert reachable("127.0.0.1", stack["POLAR_NATS_PORT"])
    for t in got:
        print(describe(t))
    assert len(got) == 2
    assert {t.outcome.value for t in got} == {"completed"}
    assert all(t.reward == 1.0 for t in got)
    # the harness's one model call, captured token-exact by the proxy container
    assert all(sum(sum(tr.loss_mask) for tr in t.traces) > 0 for t in got)
    dashboard = f"http://127.0.0.1:{stack['POLAR_DASHBOARD_PORT']}/"
    assert httpx.get(dashboard, timeout=10).status_code == 401  # no reader without the token
    read = {"authorization": f"Bearer {TOKENS['POLAR_READ_TOKEN']}"}
    assert httpx.get(dashboard, headers=read, timeout=10).status_code == 200
    # the proxy's /admin/* takes the admin token; this one asks the engine (its key)
    admin = {"authorization": f"Bearer {TOKENS['POLAR_ADMIN_TOKEN']}"}
    assert httpx.get(f"{proxy}/admin/weight_version", timeout=10).status_code == 401
    assert httpx.get(f"{proxy}/admin/weight_version", headers=admin, timeout=10).status_code == 200
