"""The Slurm templates (infra/deploy/slurm) on a one-machine Slurm cluster
(local-cluster.sh: this host as controller and node, from Debian's slurm-wlm and munge):
the services job, then an array of two gateway jobs, then a real task through them to
its trajectories, spread over both gateways.

Needs root and Slurm's daemons (`apt-get install slurm-wlm munge`; local-cluster.sh
installs them when apt can); ~60 s on two cores. The jobs run this checkout's code
with the interpreter running the test (POLAR_VENV: its venv)."""

from __future__ import annotations

import asyncio
import collections
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from infra.deploy.probe import describe, probe
from services.common.registry import Registry

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "infra/deploy/slurm"
OFFSET = 31000  # the stack's ports: 35222 (NATS), 37379 (Valkey), 39100 (scheduler), ...

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
TOKENS = {
    "POLAR_ADMIN_TOKEN": f"pa_{uuid.uuid4().hex}",
    "POLAR_READ_TOKEN": f"pr_{uuid.uuid4().hex}",
    "POLAR_ENGINE_API_KEY": f"pe_{uuid.uuid4().hex}",
}


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its daemons as root"
    if not (shutil.which("slurmctld") and shutil.which("munged")):
        return "Slurm is not installed: apt-get install slurm-wlm munge"
    return None


@pytest.fixture
def cluster(tmp_path):
    if why := _missing():
        pytest.skip(why)
    out = subprocess.run([str(SLURM / "local-cluster.sh"), "up"], capture_output=True,
                         text=True, check=True)  # fmt: skip
    conf = out.stdout.strip().removeprefix("export SLURM_CONF=")
    # the services job's credentials (polar-services.sbatch requires them); the gateway
    # jobs inherit them too (--export=ALL) and must drop them
    env = {**os.environ, "SLURM_CONF": conf, **TOKENS}
    jobs: list[str] = []

    def sbatch(*args: str) -> str:
        job = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", *args],
                             env=env, capture_output=True, text=True, check=True)  # fmt: skip
        jobs.append(job.stdout.strip())
        return jobs[-1]

    try:
        yield env, sbatch, tmp_path
    finally:
        if jobs:
            subprocess.run(["scancel", *jobs], env=env)
        # the cluster stays up (the next run reuses it): local-cluster.sh down stops it


def test_slurm_services_job_and_gateway_array_run_a_task(cluster):
    env, sbatch, shared = cluster
    venv = str(Path(sys.executable).parent.parent)
    export = f"ALL,POLAR_SHARED={shared},POLAR_VENV={venv},PYTHONPATH={ROOT}"
    services = sbatch(
        f"--export={export},POLAR_PORT_OFFSET={OFFSET},POLAR_ADVERTISE_HOST=127.0.0.1",
        str(SLURM / "polar-services.sbatch"),
    )
    sbatch("--array=0-1", f"--dependency=after:{services}",
           f"--export={export},POLAR_STACK_ENV={shared}/stack-{services}.env",
           str(SLURM / "polar-gateway.sbatch"))  # fmt: skip
    stack_env = shared / f"stack-{services}.env"
    deadline = time.monotonic() + 120
    while not stack_env.exists():
        assert time.monotonic() < deadline, subprocess.run(
            ["squeue"], env=env, capture_output=True, text=True
        ).stdout + "".join(p.read_text()[-2000:] for p in shared.glob("*.out"))
        time.sleep(0.5)
    stack = dict(line.split("=", 1) for line in stack_env.read_text().split())
    squeue = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], env=env, capture_output=True,
                            text=True).stdout  # fmt: skip
    print(squeue)

    async def run() -> collections.Counter:
        got = await probe(
            stack["POLAR_NATS_URL"], samples=8, timeout=180, wait=[stack["POLAR_PROXY_URL"]],
            scheduler=stack["POLAR_SCHEDULER_URL"], admin_token=TOKENS["POLAR_ADMIN_TOKEN"],
        )  # fmt: skip
        for t in got:
            print(describe(t))
        reg = Registry.from_url(stack["POLAR_REDIS_URL"])
        sessions = await reg.get_sessions(await reg.task_session_ids(got[0].task_id))
        assert {t.outcome.value for t in got} == {"completed"}, {s.reason for s in sessions}
        return collections.Counter(s.node for s in sessions)

    nodes = asyncio.run(run())
    print("sessions per gateway:", dict(nodes))
    assert sum(nodes.values()) == 8
    assert set(nodes) <= {"gw-0", "gw-1"}
