"""The docker runtime end to end against a real engine (podman's Docker API in CI).

`just setup` starts the engine and builds the offline test image; skipped (with the
reason) only when no engine answers or the image is missing (tests/helpers/requires.py).
"""

from __future__ import annotations

import asyncio
import functools
import io
import tarfile
import time
from pathlib import Path

import docker
import pytest

from schemas.task import DockerRuntime, ExecAction, Resources, UploadDir, UploadFile
from services.runtimes import (
    RuntimeStopped,
    SandboxStartError,
    adopt_runtime,
    create_runtime,
    run_prepare,
)
from tests.helpers.requires import DOCKER_HOST, IMAGE, requires_docker

pytestmark = requires_docker

FLAKY = "n=$(cat /tmp/count 2>/dev/null || echo 0); n=$((n+1)); echo $n > /tmp/count; [ $n -ge 3 ]"
HARNESS = (
    "for f in task.md repo/lib/a.txt; do cat $f; done > result.txt; "
    'echo "harness $HARNESS_VAR"; echo progress >&2; sleep 0.2; echo done'
)
FORKING = "sleep 1001 & setsid sleep 1002 & sh -c 'trap \"\" TERM; exec sleep 1003' & sleep 1004"


@functools.cache
def engine() -> docker.DockerClient:
    return docker.DockerClient(base_url=DOCKER_HOST)


def containers_of(runtime_id: str) -> list[object]:
    labels = {"label": f"polar.runtime={runtime_id}"}
    return engine().containers.list(all=True, filters=labels)


def docker_runtime(tmp_path: Path, session: str, **spec: object):
    return create_runtime(DockerRuntime(image=IMAGE, **spec), session, base_dir=tmp_path,
                          docker_host=DOCKER_HOST)  # fmt: skip


async def test_a_session_end_to_end(tmp_path):
    repo = tmp_path / "repo"
    (repo / "lib").mkdir(parents=True)
    (repo / "lib" / "a.txt").write_text("from repo\n")
    rt = docker_runtime(tmp_path, "dk-1", network="none", env={"HARNESS_VAR": "set"},
                        resources=Resources(cpus=0.5, memory_mb=128))  # fmt: skip
    await rt.start()
    assert [c.status for c in containers_of(rt.runtime_id)] == ["running"]
    prepare = [
        UploadFile(dest="task.md", content="the task\n"),
        UploadDir(src=str(repo), dest="repo"),
        ExecAction(command=FLAKY, retries=2, backoff_seconds=0.05),
    ]
    logs = await run_prepare(rt, prepare, log_dir=tmp_path / "logs")
    assert [(log.ok, len(log.attempts)) for log in logs] == [(True, 1), (True, 1), (True, 3)]

    log_file = tmp_path / "harness.log"
    with log_file.open("ab") as sink:
        harness = await rt.spawn(HARNESS, stdout=sink.write, stderr=sink.write, timeout=30)
        status = await harness.wait(timeout=30)
    assert status.exit_code == 0 and not status.timed_out
    assert sorted(log_file.read_text().splitlines()) == ["done", "harness set", "progress"]
    assert await rt.download("result.txt") == b"the task\nfrom repo\n"
    with tarfile.open(fileobj=io.BytesIO(await rt.download_tar("repo"))) as tar:
        assert sorted(tar.getnames()) == ["lib", "lib/a.txt"]

    await rt.stop()
    await rt.stop()
    assert containers_of(rt.runtime_id) == []
    with pytest.raises(RuntimeStopped):
        await rt.exec("true")


async def test_limits_network_mounts_and_stdin(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "in.txt").write_text("mounted")
    rt = docker_runtime(tmp_path, "dk-2", network="none", mounts=[f"{shared}:/data:ro"],
                        resources=Resources(cpus=0.5, memory_mb=96))  # fmt: skip
    async with rt:
        (container,) = containers_of(rt.runtime_id)
        host_config = container.attrs["HostConfig"]
        assert host_config["NanoCpus"] == 500_000_000
        assert host_config["Memory"] == 96 * 1024 * 1024
        assert (await rt.exec("ls /sys/class/net")).stdout.split() == [b"lo"]
        assert (await rt.exec("cat /data/in.txt")).stdout == b"mounted"
        assert not (await rt.exec("touch /data/x")).ok
        await rt.exec("mkdir sub")
        r = await rt.exec(["sh", "-c", "cat; pwd"], stdin=b"piped\n", cwd="sub")
        assert r.stdout == b"piped\n/workspace/sub\n"
        missing = await rt.exec(["no-such-binary"])
        assert missing.exit_code == 127 and b"no-such-binary" in missing.stderr


async def test_exec_timeout_kills_forked_children_in_the_container(tmp_path):
    rt = docker_runtime(tmp_path, "dk-3", network="none")
    async with rt:
        started = time.monotonic()
        r = await rt.exec(FORKING, timeout=1.0, grace=0.3)
        assert r.timed_out and time.monotonic() - started < 5
        ps = (await rt.exec("ps -o args")).stdout.decode()
        assert "sleep 100" not in ps, ps
        # The in-container backstop alone (as if the node had died) also kills the tree.
        r = await rt.exec(["timeout", "-s", "KILL", "1", "sh", "-c", "sleep 5"], timeout=20)
        assert r.exit_code == 137 and not r.timed_out


async def test_cancel_during_exec_leaves_no_container(tmp_path):
    rt = docker_runtime(tmp_path, "dk-4", network="none")
    await rt.start()
    running = asyncio.create_task(rt.exec(FORKING, timeout=60))
    await asyncio.sleep(0.5)
    started = time.monotonic()
    await rt.cancel()
    with pytest.raises(RuntimeStopped):
        await running
    assert time.monotonic() - started < 10
    assert rt.state == "cancelled"
    assert containers_of(rt.runtime_id) == []


async def test_missing_image_fails_start_and_leaves_nothing(tmp_path):
    rt = create_runtime(DockerRuntime(image="localhost:1/polar-missing:latest"), "dk-5",
                        base_dir=tmp_path, docker_host=DOCKER_HOST)  # fmt: skip
    with pytest.raises(SandboxStartError):
        await rt.start()
    assert rt.state == "stopped"
    assert containers_of(rt.runtime_id) == []


async def test_start_replaces_a_crashed_runs_container(tmp_path):
    first = docker_runtime(tmp_path, "dk-6", network="none")
    await first.start()
    await first.exec("echo old > marker")
    second = docker_runtime(tmp_path, "dk-6", network="none")  # same runtime id
    async with second:
        assert not (await second.exec("test -e marker")).ok
        assert len(containers_of(second.runtime_id)) == 1
    await first.stop()
    assert containers_of(second.runtime_id) == []


async def test_detach_then_adopt_hands_the_container_over(tmp_path):
    spec = DockerRuntime(image=IMAGE, network="none", env={"HOME": "/tmp/home"})
    pool_side = create_runtime(spec, "dk-7", base_dir=tmp_path, docker_host=DOCKER_HOST)
    await pool_side.start()
    assert pool_side.home == "/tmp/home"  # probed inside the container
    await pool_side.upload_file("prepared.txt", b"ready")
    await pool_side.detach()
    await pool_side.stop()  # no-op: the detached object no longer owns the container
    assert [c.status for c in containers_of("dk-7-a0-main")] == ["running"]

    executor_side = adopt_runtime(spec, "dk-7", "dk-7-a0-main", base_dir=tmp_path,
                                  docker_host=DOCKER_HOST)  # fmt: skip
    assert executor_side.home == "/tmp/home"  # from the record the starter left
    assert await executor_side.download("prepared.txt") == b"ready"
    proc = await executor_side.spawn("sleep 1000")
    await executor_side.stop(grace=0.2)
    assert (await proc.wait(5)).exit_code in (None, 137, 143)
    assert containers_of("dk-7-a0-main") == []
    assert not (tmp_path / "dk-7-a0-main").exists()


async def test_adopting_an_abandoned_container_removes_it(tmp_path):
    spec = DockerRuntime(image=IMAGE, network="none")
    abandoned = create_runtime(spec, "dk-8", base_dir=tmp_path, docker_host=DOCKER_HOST)
    await abandoned.start()
    await abandoned.exec("sleep 1000 > /dev/null 2>&1 &")
    del abandoned  # its process died
    reaper_side = adopt_runtime(spec, "dk-8", "dk-8-a0-main", base_dir=tmp_path,
                                docker_host=DOCKER_HOST)  # fmt: skip
    await reaper_side.stop()
    assert containers_of("dk-8-a0-main") == []


async def test_a_short_exec_never_loses_its_output(tmp_path):
    """podman's Docker API dropped what an exec wrote before the attach was in place: 3 of
    60 `cat` execs came back empty with exit code 0 under load. Each exec now waits for
    the client's handshake (docker_exec.attached_argv)."""
    rt = docker_runtime(tmp_path, "dk-out", network="none")
    async with rt:
        results = [await rt.exec(["echo", f"out {i}"]) for i in range(40)]
    lost = [i for i, r in enumerate(results) if r.stdout != f"out {i}\n".encode()]
    assert lost == [] and all(r.exit_code == 0 for r in results)
