"""The real ``polar`` CLI in subprocesses, against a stack it starts itself on free ports."""

import json
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from infra import credentials
from infra.localservers import free_port
from tests.helpers.polar_cli import run_polar
from tests.integration.test_devstack import only_scheduler

pytestmark = pytest.mark.timeout(120)


class Polar:
    def __init__(self, topology: Path, ports: dict[str, int]) -> None:
        self.topology, self.ports = topology, ports

    def __call__(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return run_polar(*args, "--topology", str(self.topology), timeout=timeout, columns=200)

    @property
    def scheduler(self) -> str:
        return f"http://127.0.0.1:{self.ports['scheduler']}"

    @property
    def admin(self) -> dict[str, str]:
        """The admin token `polar up` generated, as the scheduler wants it."""
        creds = credentials.load(self.topology.parent / "state")
        return {"authorization": f"Bearer {creds.admin_token}"}


@pytest.fixture(scope="module")
def polar(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    names = ("nats", "redis", "scheduler", "builder", "evaluator")
    ports = {name: free_port() for name in names}
    # builder and evaluator too: a session whose deadline passes before it runs is still
    # built and delivered (an empty ERROR trajectory) before it ends
    work = f"{{work_dir: '{root / 'work'}'}}"
    topo = root / "topology.yaml"
    topo.write_text(
        f"""
nats_url: nats://127.0.0.1:{ports["nats"]}
redis_url: redis://127.0.0.1:{ports["redis"]}/0
state_dir: {root / "state"}
{only_scheduler(ports["scheduler"], "{reconcile_interval_seconds: 0.3}")}""".replace(
            "  builder: {enabled: false}\n", f"  builder: {{port: {ports['builder']}}}\n"
        ).replace(
            "  evaluator: {enabled: false}\n",
            f"  evaluator: {{port: {ports['evaluator']}, config: {work}}}\n",
        )
    )
    cli = Polar(topo, ports)
    up = cli("up")
    assert up.returncode == 0, up.stdout + up.stderr
    for name, port in ports.items():
        assert f"127.0.0.1:{port}" in up.stdout, (name, up.stdout)
    yield cli
    down = cli("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped: evaluator, builder, scheduler, redis, nats" in down.stdout
    for port in ports.values():
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_bad_task_shows_why_it_was_rejected(polar, tmp_path):
    bad = write(
        tmp_path / "bad.json", '{"instruction": "x", "evaluator": {"name": "nosuchmod:Eval"}}'
    )
    over_bus = polar("submit", str(bad))
    assert over_bus.returncode == 1, over_bus.stdout + over_bus.stderr
    assert "rejected (scheduler) at $.evaluator.name" in over_bus.stdout
    assert "module 'nosuchmod' is not importable" in over_bus.stdout

    over_http = polar("submit", str(bad), "--via", "http")
    assert over_http.returncode == 1
    assert "rejected (HTTP 400) at $.evaluator.name" in over_http.stdout

    typo = write(tmp_path / "typo.yaml", "instruction: x\nnum_sampels: 2\n")
    checked = polar("submit", str(typo))
    assert checked.returncode == 1
    assert "rejected (local check) at $.num_sampels: Unknown field" in checked.stdout


def test_submit_over_http_and_wait_for_the_results_table(polar, tmp_path):
    task = write(
        tmp_path / "t.json",
        '{"task_id": "cli-http", "instruction": "hi", "num_samples": 2, "timeout_seconds": 0.5}',
    )
    r = polar("submit", str(task), "--via", "http", "--wait", "--timeout", "30")
    assert r.returncode == 3, r.stdout + r.stderr  # no session completed
    assert "accepted: task cli-http, 2 session(s)" in r.stdout
    assert "task cli-http: failed" in r.stdout  # every session ERROR (issue 38.11)
    for sid in ("cli-http-0000", "cli-http-0001"):
        row = next(line for line in r.stdout.splitlines() if sid in line)
        assert "ERROR" in row and "deadline passed" in row
    assert (
        "error: no session completed (2 ERROR); every one: deadline passed before the "
        "session ran" in " ".join(r.stderr.split())
    )


def test_submit_yaml_over_the_bus_and_wait(polar, tmp_path):
    task = write(tmp_path / "t.yaml", "instruction: hi\nnum_samples: 3\ntimeout_seconds: 0.5\n")
    r = polar("submit", str(task), "--wait", "--timeout", "30")
    assert r.returncode == 3, r.stdout + r.stderr  # every session ended ERROR
    assert "no session completed (3 ERROR)" in r.stderr
    task_id = r.stdout.split("accepted: task ", 1)[1].split(",", 1)[0]
    assert f"task {task_id}: failed" in r.stdout
    assert sum(f"{task_id}-000{i}" in r.stdout for i in range(3)) == 3
    assert "3/3" in r.stdout  # the progress bar's last frame
    same = write(
        tmp_path / "same.yaml",
        f"task_id: {task_id}\ninstruction: hi\nnum_samples: 3\ntimeout_seconds: 0.5\n",
    )
    again = polar("submit", str(same))
    assert again.returncode == 0 and "(submitted before)" in again.stdout
    other = write(tmp_path / "other.yaml", f"task_id: {task_id}\ninstruction: hi\nnum_samples: 2\n")
    conflict = polar("submit", str(other))
    assert conflict.returncode == 1
    assert "rejected (registry) at $.task_id" in conflict.stdout
    assert "already exists with a different spec" in conflict.stdout


def settled(polar, task_id: str, timeout: float = 30.0) -> dict:
    """The task as the scheduler's HTTP API shows it, once no longer active (a cancelled
    session still goes through the builder and the evaluator before it is final)."""
    deadline = time.monotonic() + timeout
    while True:
        url = f"{polar.scheduler}/tasks/{task_id}"
        body = httpx.get(url, headers=polar.admin, trust_env=False).json()
        if body["status"] != "active" or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def test_cancel_over_the_bus_and_http(polar, tmp_path):
    task = write(
        tmp_path / "t.json", '{"task_id": "cli-cancel", "instruction": "hi", "num_samples": 2}'
    )
    assert polar("submit", str(task)).returncode == 0
    r = polar("cancel", "cli-cancel")
    assert r.returncode == 0 and "cancel of cli-cancel published" in r.stdout
    body = settled(polar, "cli-cancel")
    assert body["status"] == "cancelled" and body["counts"] == {"CANCELLED": 2}
    for via in ("http", "bus"):  # on the bus it printed "published" and exited 0
        missing = polar("cancel", "no-such-task", "--via", via)
        assert missing.returncode == 1 and "no task 'no-such-task'" in missing.stderr, via
    # a live task, cancelled over the scheduler's HTTP API
    live = write(tmp_path / "l.json", '{"task_id": "cli-cancel-http", "instruction": "hi"}')
    assert polar("submit", str(live)).returncode == 0
    r = polar("cancel", "cli-cancel-http", "--via", "http")
    assert r.returncode == 0, r.stderr
    body = settled(polar, "cli-cancel-http")
    assert body["status"] == "cancelled" and body["counts"] == {"CANCELLED": 1}


def test_status_shows_services_streams_and_sessions(polar):
    task = {"task_id": "cli-status", "instruction": "hi", "num_samples": 3}
    r = httpx.post(f"{polar.scheduler}/tasks", json=task, headers=polar.admin, trust_env=False)
    assert r.status_code == 201
    r = polar("status", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["errors"] == []
    assert [(s["name"], s["status"]) for s in report["services"]] == [
        ("scheduler", 200), ("builder", 200), ("evaluator", 200),
    ]  # fmt: skip
    streams = {s["name"]: s for s in report["streams"]}
    assert streams["POLAR_TASKS"]["messages"] >= 1
    assert {c["name"] for c in streams["POLAR_TASKS"]["consumers"]} >= {"scheduler-submit"}
    assert streams["POLAR_SESSIONS"]["messages"] >= 3  # init work nobody consumes yet
    assert report["sessions"]["REGISTERED"] >= 3
    assert report["nodes"] == []

    text = polar("status")
    assert text.returncode == 0
    for expected in (
        "healthy",
        "stream backlogs",
        "POLAR_TASKS",
        "scheduler-submit",
        "sessions by state",
        "REGISTERED",
    ):
        assert expected in text.stdout, (expected, text.stdout)


def test_unreachable_nats_fails_fast():
    import asyncio
    import time

    from services.cli.connect import open_bus
    from services.cli.context import Unreachable

    async def attempt():
        with pytest.raises(Unreachable):
            await open_bus(f"nats://127.0.0.1:{free_port()}")

    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(attempt(), 20))
    assert time.monotonic() - t0 < 10


def test_up_refuses_a_topology_that_cannot_work_before_starting_anything(tmp_path):
    """Token mode (the default) with an SGLang backend and no model_dir: no tokenizer to
    template with. `polar up` says so and what to set, and starts nothing."""
    nats, redis = free_port(), free_port()
    state = tmp_path / "state"
    topo = write(
        tmp_path / "topology.yaml",
        f"""
nats_url: nats://127.0.0.1:{nats}
redis_url: redis://127.0.0.1:{redis}/0
state_dir: {state}
services: {{model: {{enabled: false}}}}
backends: [{{kind: sglang, url: 'http://127.0.0.1:{free_port()}'}}]
""",
    )
    up = Polar(topo, {})("up", timeout=30)
    assert up.returncode == 1, up.stdout + up.stderr
    assert "this topology cannot work" in up.stderr
    assert "token mode" in up.stderr and "model_dir" in up.stderr and "mode: chat" in up.stderr
    assert not state.exists()  # no record, no logs, no NATS or Valkey data
    for port in (nats, redis):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
