"""``polar up`` / ``polar down`` (infra.devstack) with real servers and processes."""

import os
import socket
import time

import httpx
import pytest

from infra import devstack
from infra.catalog import SERVICES
from infra.localservers import free_port, reachable
from infra.stackstate import StackState, alive, group_members, read_state, write_state
from infra.topology import parse_topology

pytestmark = pytest.mark.timeout(90)


def only_scheduler(port: int, config: str = "{}") -> str:
    """The `services:` block: the scheduler on ``port``; every other catalog service off."""
    others = "".join(f"  {name}: {{enabled: false}}\n" for name in SERVICES if name != "scheduler")
    return f"services:\n  scheduler: {{port: {port}, config: {config}}}\n{others}"


def topology(state_dir, nats_url: str, redis_url: str, port: int, config: str = "{}"):
    return parse_topology(f"""
nats_url: {nats_url}
redis_url: {redis_url}
state_dir: {state_dir}
startup_timeout_seconds: 45
{only_scheduler(port, config)}""")


def refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) != 0


def no_process_left(pid: int) -> bool:
    """Neither the pid nor any member of the process group it led exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return group_members(pid) == []
    return False


@pytest.fixture
def stacks():
    """Stops any stack a failing test leaves behind."""
    dirs = []
    yield dirs.append
    for d in dirs:
        devstack.down(d)


def test_up_starts_its_own_servers_and_down_leaves_nothing(tmp_path, stacks):
    nats_port, redis_port, port = free_port(), free_port(), free_port()
    assert not reachable("127.0.0.1", nats_port) and not reachable("127.0.0.1", redis_port)
    topo = topology(
        tmp_path, f"nats://127.0.0.1:{nats_port}", f"redis://127.0.0.1:{redis_port}/0", port
    )
    stacks(tmp_path)
    state = devstack.up(topo)

    assert [(p.name, p.port, p.started) for p in state.procs] == [
        ("nats", nats_port, True),
        ("redis", redis_port, True),
        ("scheduler", port, True),
    ]
    assert all(alive(p.pid, p.start_ticks) for p in state.procs)
    assert read_state(tmp_path) == state
    assert (tmp_path / "nats" / "jetstream").is_dir()
    assert (tmp_path / "logs" / "scheduler.log").stat().st_size > 0
    base = f"http://127.0.0.1:{port}"
    health = httpx.get(f"{base}/healthz", trust_env=False)
    assert health.status_code == 200 and health.json()["checks"]["nats"] is True
    r = httpx.post(f"{base}/tasks", json={"instruction": "hi", "num_samples": 2}, trust_env=False)
    assert r.status_code == 201, r.text
    task = httpx.get(f"{base}/tasks/{r.json()['task_id']}", trust_env=False).json()
    assert task["counts"] == {"REGISTERED": 2}

    assert devstack.up(topo).procs == state.procs  # already up: a no-op

    report = devstack.down(tmp_path)
    assert report.stopped == ["scheduler", "redis", "nats"]
    assert report.still_listening == [] and report.left_running == []
    for p in state.procs:
        assert no_process_left(p.pid), p
    for port_ in (nats_port, redis_port, port):
        assert refused(port_)
    assert read_state(tmp_path) is None


def test_up_reuses_reachable_servers_and_down_leaves_them_running(
    tmp_path, stacks, nats_url, redis_url
):
    port = free_port()
    stacks(tmp_path)
    state = devstack.up(topology(tmp_path, nats_url, redis_url, port))
    assert [(p.name, p.pid, p.started) for p in state.procs[:2]] == [
        ("nats", None, False),
        ("redis", None, False),
    ]
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", trust_env=False).status_code == 200
    assert not (tmp_path / "nats").exists()  # no server of ours

    report = devstack.down(tmp_path)
    assert report.stopped == ["scheduler"] and report.left_running == ["redis", "nats"]
    assert no_process_left(state.procs[2].pid) and refused(port)
    assert reachable("127.0.0.1", int(nats_url.rsplit(":", 1)[1]))
    assert reachable("127.0.0.1", int(redis_url.rsplit(":", 1)[1].split("/")[0]))


def test_a_service_that_fails_stops_everything_started(tmp_path, stacks):
    nats_port, redis_port, port = free_port(), free_port(), free_port()
    topo = topology(
        tmp_path,
        f"nats://127.0.0.1:{nats_port}",
        f"redis://127.0.0.1:{redis_port}/0",
        port,
        config="{bogus_key: 1}",
    )
    stacks(tmp_path)
    with pytest.raises(devstack.StackError) as err:
        devstack.up(topo)
    message = str(err.value)
    assert "scheduler exited" in message and "unknown field `bogus_key`" in message  # the log tail
    assert read_state(tmp_path) is None
    assert all(refused(p) for p in (nats_port, redis_port, port))


def test_a_stale_record_is_cleaned_and_a_busy_port_refused(tmp_path, stacks, nats_url, redis_url):
    dead = StackState(state_dir=str(tmp_path), created_at=0.0)
    dead.procs.append(
        devstack.Proc(
            name="scheduler", pid=2**22 + 7, start_ticks=1, url="http://x", port=1, started=True
        )
    )
    write_state(dead)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(devstack.StackError, match=f"port.s. already in use: scheduler:{port}"):
            devstack.up(topology(tmp_path, nats_url, redis_url, port))
    assert read_state(tmp_path) is None  # the stale record went; nothing was started


def test_a_service_start_up_error_is_reported_at_once_with_its_own_message(
    tmp_path, stacks, nats_url, redis_url
):
    """The proxy fails in its lifespan (granian itself logs only "Unexpected exit from
    worker-1"); `polar up` names the cause as soon as the process exits, and the cause
    is in the proxy's log, while the model service ahead of it is still starting."""
    missing = tmp_path / "no-such-model"
    others = "".join(
        f"  {name}: {{enabled: false}}\n" for name in SERVICES if name not in ("proxy", "model")
    )
    topo = parse_topology(f"""
nats_url: {nats_url}
redis_url: {redis_url}
state_dir: {tmp_path}
startup_timeout_seconds: 120
backends: [{{kind: sglang, url: 'http://127.0.0.1:{free_port()}'}}]
services:
  model: {{port: 0}}
  proxy: {{port: 0, config: {{mode: token, model_dir: '{missing}', probe_backend: false}}}}
{others}""")
    stacks(tmp_path)
    lines: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(devstack.StackError) as err:
        devstack.up(topo, log=lines.append)
    elapsed = time.monotonic() - t0
    cause = f"TokenizerLoadError: {missing} has no tokenizer.json"
    assert cause in (tmp_path / "logs" / "proxy.log").read_text()  # logged by the proxy
    first = str(err.value).splitlines()[0]
    assert first.startswith("proxy exited with code 1 before it was healthy: ") and cause in first
    assert any(line.startswith("proxy exited") and cause in line for line in lines)  # printed
    assert elapsed < 60, elapsed
    assert read_state(tmp_path) is None
