"""The Kubernetes manifests' pods (infra/deploy/k8s) in podman, played by
infra/deploy/k8s/podman_pods.py since `podman kube play` 4.3 runs no StatefulSet: the
3-node JetStream cluster, a Valkey primary + two replicas under three Sentinels, and
every service with its replicas. A task runs to its trajectories; then the Valkey
primary and one NATS server are stopped, and another task runs once the sentinels have
failed over: the new primary, with one replica left and `min-replicas-to-write 1`,
takes its writes. The old primary, started again, rejoins as a replica.

Needs the image (`just image`); ~2 min on two cores."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid

import pytest

from infra.deploy.k8s import podman_pods
from tests.deploy.test_compose import IMAGE, _missing, _podman_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

NATS = ",".join(f"nats://nats-{i}.nats:4222" for i in range(3))
# the admin key of Secret polar-tokens as the manifests ship it (podman_pods plays them)
ADMIN_TOKEN = next(
    d["stringData"]["admin"]
    for d in podman_pods.load()
    if d["kind"] == "Secret" and d["metadata"]["name"] == "polar-tokens"
)


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], env=_podman_env(), capture_output=True,
                          text=True, check=check)  # fmt: skip


@pytest.fixture
def pods():
    if why := _missing():
        pytest.skip(why)
    prefix = f"k8stest{uuid.uuid4().hex[:6]}"
    os.environ["CONTAINERS_CONF"] = _podman_env().get("CONTAINERS_CONF", "")
    try:
        net = podman_pods.up(IMAGE, prefix)
        yield prefix, net
    finally:
        podman_pods.down(prefix)


def probe_in(net: str, samples: int) -> str:
    """The probe run from a container on the pods' network (no port is published)."""
    # submitted through the scheduler with the admin token of Secret polar-tokens
    out = podman("run", "--rm", "--network", net, "-e", f"POLAR_ADMIN_TOKEN={ADMIN_TOKEN}",
                 IMAGE, "python", "-m", "infra.deploy.probe",
                 "--nats", NATS, "--samples", str(samples), "--sandbox", "none",
                 "--wait", "http://proxy:8200", "--scheduler", "http://scheduler:8100",
                 "--timeout", "180", check=False)  # fmt: skip
    print(out.stdout, out.stderr[-2000:])
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def valkey_state(prefix: str, pod: str) -> dict:
    """A Valkey pod's replication info and min-replicas settings, asked inside it."""
    ask = ("import json, os, redis; r = redis.Redis(password=os.environ['PASSWORD']); "
           "print(json.dumps({**r.info('replication'), **r.config_get('min-replicas-*')}))")  # fmt: skip
    return json.loads(podman("exec", f"{prefix}-{pod}-valkey", "python", "-c", ask).stdout)


def test_k8s_pods_run_a_task_and_ride_a_valkey_failover_and_a_nats_loss(pods):
    prefix, net = pods
    stdout = probe_in(net, 4)
    assert stdout.count("outcome=completed reward=1.0") == 4
    podman("stop", "-t", "1", f"{prefix}-valkey-0-valkey", f"{prefix}-nats-1-nats")
    sentinel = f"{prefix}-valkey-sentinel-0-sentinel"
    switched = re.compile(r"\+switch-master polar valkey-0\.valkey 6379 (valkey-[12])\.valkey")
    deadline = time.monotonic() + 60
    while not (found := switched.search((logs := podman("logs", sentinel)).stdout + logs.stderr)):
        assert time.monotonic() < deadline, "the sentinels did not fail over in 60 s"
        time.sleep(1)
    primary = found.group(1)
    # valkey-0 still down: the new primary has the other replica only, and takes writes
    stdout = probe_in(net, 4)
    assert stdout.count("outcome=completed reward=1.0") == 4
    state = valkey_state(prefix, primary)
    print(primary, {k: state[k] for k in ("role", "connected_slaves", "min-replicas-to-write")})
    assert state["role"] == "master" and state["connected_slaves"] == 1
    assert state["min-replicas-to-write"] == "1"
    podman("start", f"{prefix}-valkey-0-valkey", f"{prefix}-nats-1-nats")
    deadline = time.monotonic() + 60
    while (
        f"Connecting to PRIMARY {primary}.valkey:6379"
        not in (logs := podman("logs", f"{prefix}-valkey-0-valkey")).stdout + logs.stderr
    ):
        assert time.monotonic() < deadline, "valkey-0 did not rejoin as a replica"
        time.sleep(1)
    assert valkey_state(prefix, "valkey-0")["role"] == "slave"
